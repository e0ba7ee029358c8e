//! One endpoint-picker decision for a ~4,000-token chat request, as the ext_proc stream
//! makes it: parse the OpenAI body, render the chat template, tokenize (a byte-level BPE
//! trained by `testkit::chat_tokenizer`), select and book, then free.
//!
//! - `ext_proc/pick/chat_4k`: the whole pick (on tokio, tokenizing on the blocking pool as
//!   the server does) plus the free.
//! - `ext_proc/tokenize/chat_4k`: parse + render + tokenize alone, for the share.
//! - `ext_proc/pick/token_ids_4k`: the same prompt sent as token ids (no tokenizing): parse,
//!   select, book, free.
//!
//! The service has 16 event-driven workers of block size 16; one of them holds the chat's
//! first 3,000 tokens in the index, so each lookup walks a real chain. After criterion, a
//! timed loop prints p50/p99 of the pick and of the tokenizing (criterion reports means
//! and medians only).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use ext_proc::{
    ExtProcMetrics, InferenceRequest, ModelTokenizer, PickInput, Picker, PickerConfig, Tokenizers,
    parse_request,
};
use kv_types::{
    BlockHash, ExternalHash, HashOptions, KvOperation, KvOperationKind, StorageTier, StoredBlock,
    WorkerKey,
};
use serde_json::json;
use service_builder::{PartitionKey, SelectionServiceBuilder, WorkerRequest};

const MODEL: &str = "chat";
const BLOCK: u32 = 16;
const WORKERS: u64 = 16;
/// Turns of user and assistant text; each turn a few sentences, varied by its index.
const TURNS: usize = 22;

struct Fixture {
    runtime: tokio::runtime::Runtime,
    picker: Arc<Picker>,
    tokenizer: Arc<ModelTokenizer>,
    chat: Vec<u8>,
    ids: Vec<u8>,
    prompt_tokens: usize,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn chat_body() -> serde_json::Value {
    let sentences = [
        "Explain how a key-value cache speeds up transformer inference for long prompts.",
        "The cache stores the attention keys and values of every token already processed.",
        "Routing requests to the worker that already holds their prefix saves prefill time.",
        "Summarize the following document in three sentences for a busy reader.",
        "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    ];
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    for t in 0..TURNS {
        let role = if t % 2 == 0 { "user" } else { "assistant" };
        let content: Vec<String> = (0..4)
            .map(|i| format!("{} (part {t}.{i})", sentences[(t + i) % sentences.len()]))
            .collect();
        messages.push(json!({"role": role, "content": content.join(" ")}));
    }
    json!({"model": MODEL, "messages": messages, "stream": true})
}

fn fixture() -> Fixture {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let dir = TempDir(std::env::temp_dir().join(format!(
        "bench-ext-proc-{}-{}",
        std::process::id(),
        testkit::free_port()
    )));
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    testkit::chat_tokenizer(&dir.0);
    let tokenizers = Tokenizers::load([(MODEL, dir.0.as_path())]).expect("tokenizer loads");
    let tokenizer = Arc::clone(tokenizers.get(MODEL).expect("the chat model"));

    let chat = serde_json::to_vec(&chat_body()).expect("body");
    let Ok(InferenceRequest::Chat { messages, .. }) = parse_request(&chat) else {
        panic!("the bench body is a chat request");
    };
    let tokens = tokenizer
        .encode_chat(&messages, None, None)
        .expect("the chat tokenizes");
    let ids =
        serde_json::to_vec(&json!({"model": MODEL, "prompt": tokens})).expect("token-id body");

    let service = {
        let _guard = runtime.enter();
        SelectionServiceBuilder::new(benches::seeded_config(true))
            .build()
            .expect("service builds")
    };
    let core = service.core();
    let partition = PartitionKey::new(MODEL, "default");
    for w in 0..WORKERS {
        // Nobody publishes on these ports: the listeners wait, the workers are schedulable.
        let events = format!("tcp://127.0.0.1:{}", testkit::free_port());
        core.upsert_worker(WorkerRequest {
            model_name: MODEL.into(),
            endpoint: Some(format!("10.0.0.{w}:8000")),
            block_size: Some(BLOCK),
            kv_events_endpoint: Some(events),
            ..WorkerRequest::new(w)
        })
        .expect("worker registers");
    }
    let mut hashes: Vec<BlockHash> = Vec::new();
    kv_types::block_hashes_into(
        &tokens[..tokens.len().min(3000)],
        BLOCK,
        &HashOptions::default(),
        &mut hashes,
    );
    let blocks = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock::new(ExternalHash(h.0 ^ i as u64), *h))
        .collect();
    core.apply_events(
        &partition,
        &[KvOperation {
            worker: WorkerKey::new(WORKERS / 2, 0),
            tier: StorageTier::Device,
            event_id: 1,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks,
            },
        }],
    );
    let picker = Arc::new(Picker::new(
        Arc::new(service),
        tokenizers,
        ExtProcMetrics::default(),
        PickerConfig::default(),
    ));
    Fixture {
        runtime,
        picker,
        tokenizer,
        chat,
        ids,
        prompt_tokens: tokens.len(),
        _dir: dir,
    }
}

/// One pick of `body` and its free; the chosen worker.
fn pick_and_free(f: &Fixture, body: &[u8]) -> u64 {
    f.runtime.block_on(async {
        let input = PickInput {
            body,
            ..PickInput::default()
        };
        let mut booking = f.picker.pick(input).await.expect("picks");
        booking.finish();
        booking.worker_id()
    })
}

/// Parse, render and tokenize `body`; the token count.
fn tokenize(f: &Fixture, body: &[u8]) -> usize {
    let Ok(InferenceRequest::Chat { messages, .. }) = parse_request(body) else {
        panic!("a chat request");
    };
    f.tokenizer
        .encode_chat(&messages, None, None)
        .expect("tokenizes")
        .len()
}

fn bench(c: &mut Criterion) {
    let f = fixture();
    assert_eq!(
        pick_and_free(&f, &f.chat),
        WORKERS / 2,
        "the cached prefix decides"
    );
    let mut group = c.benchmark_group("ext_proc");
    group.bench_function("pick/chat_4k", |b| b.iter(|| pick_and_free(&f, &f.chat)));
    group.bench_function("tokenize/chat_4k", |b| b.iter(|| tokenize(&f, &f.chat)));
    group.bench_function("pick/token_ids_4k", |b| {
        b.iter(|| pick_and_free(&f, &f.ids))
    });
    group.finish();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn timed(n: usize, mut run: impl FnMut()) -> (Duration, Duration) {
    let mut samples: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed()
        })
        .collect();
    samples.sort_unstable();
    (percentile(&samples, 0.50), percentile(&samples, 0.99))
}

/// p50/p99 of single picks and of tokenizing alone.
#[expect(clippy::print_stdout, reason = "a bench reports on stdout")]
fn percentiles(n: usize) {
    let f = fixture();
    let (pick50, pick99) = timed(n, || {
        pick_and_free(&f, &f.chat);
    });
    let (tok50, tok99) = timed(n, || {
        tokenize(&f, &f.chat);
    });
    let (ids50, ids99) = timed(n, || {
        pick_and_free(&f, &f.ids);
    });
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "ext_proc pick of a {}-token chat ({} body bytes), n={n}: \
         pick p50={:.0} µs p99={:.0} µs; parse+render+tokenize p50={:.0} µs p99={:.0} µs \
         ({:.0} % of the pick at p50); token-id pick p50={:.0} µs p99={:.0} µs",
        f.prompt_tokens,
        f.chat.len(),
        us(pick50),
        us(pick99),
        us(tok50),
        us(tok99),
        100.0 * tok50.as_secs_f64() / pick50.as_secs_f64(),
        us(ids50),
        us(ids99),
    );
}

criterion_group!(benches, bench);

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then a short smoke
    // run of the percentile loop.
    let full = std::env::args().any(|a| a == "--bench");
    benches();
    Criterion::default().configure_from_args().final_summary();
    percentiles(if full { 1000 } else { 10 });
}
