//! `select_and_reserve` + `free` through the service core: 8, 64, 128 and 512 workers,
//! prompts of 256 and 4,096 tokens, block size 16. The index holds, per worker, a distinct
//! 4k-token prefix plus a shared system prompt, so every lookup walks a real tree. The main
//! groups run the default (event-driven) configuration; `approximate` repeats the 128-worker
//! case with `use_kv_events=false`, where every booking also records its blocks in the index.
//! `select/10_partitions_of_120` selects in the last of ten models (1,200 workers), and
//! `register_and_delete` measures the catalog with 1,000 and 10,000 workers.

use std::sync::Arc;

use benches::service_fixture::{BLOCK, core_with, prompt, reserve_and_free, reserve_request};
use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use service_builder::{PartitionKey, PromptInput, SelectRequest, SelectionCore, WorkerRequest};

fn service(c: &mut Criterion) {
    let mut group = c.benchmark_group("service/select_and_reserve_free");
    for workers in [8u64, 64, 128, 512] {
        let core = core_with(workers, true);
        for tokens in [256usize, 4096] {
            group.bench_with_input(
                BenchmarkId::new(format!("{workers}_workers"), tokens),
                &reserve_request(workers, tokens),
                |b, req| {
                    // The request is owned by the call (the HTTP edge hands over the parsed
                    // body); its clone is setup, not part of the measurement.
                    b.iter_batched(
                        || req.clone(),
                        |req| reserve_and_free(&core, req),
                        BatchSize::SmallInput,
                    )
                },
            );
        }
    }
    group.finish();

    let mut group = c.benchmark_group("service/select_and_reserve_free/approximate");
    let core = core_with(128, false);
    let request = reserve_request(128, 4096);
    group.bench_function("128_workers/4096", |b| {
        b.iter_batched(
            || request.clone(),
            |req| reserve_and_free(&core, req),
            BatchSize::SmallInput,
        )
    });
    group.finish();

    // The query path alone (no booking, nothing recorded), for the split.
    let mut group = c.benchmark_group("service/select");
    for workers in [8u64, 128, 512] {
        let core = core_with(workers, true);
        let request = SelectRequest {
            prompt: PromptInput {
                token_ids: Some(prompt(workers / 2, 4096)),
                ..PromptInput::default()
            },
            ..SelectRequest::default()
        };
        group.bench_with_input(
            BenchmarkId::new(format!("{workers}_workers"), 4096),
            &request,
            |b, req| {
                b.iter_batched(
                    || req.clone(),
                    |req| core.select(req).expect("selects").worker_id,
                    BatchSize::SmallInput,
                )
            },
        );
    }
    group.finish();
}

/// Selection in one of many partitions: 1,200 workers in ten models of 120 (contiguous
/// ids, approximate mode so no listener runs), a 256-token `select` in the last model, so
/// the other nine partitions' workers come first in the catalog.
fn partitions(c: &mut Criterion) {
    let config = benches::seeded_config(false);
    let core = SelectionCore::try_new_local(config, None).expect("valid config");
    for w in 0..1_200u64 {
        core.upsert_worker(WorkerRequest {
            endpoint: Some(format!("http://w{w}")),
            block_size: Some(BLOCK),
            model_name: format!("model-{}", w / 120),
            ..WorkerRequest::new(w)
        })
        .expect("worker registers");
    }
    let request = SelectRequest {
        partition: PartitionKey::new("model-9", "default"),
        prompt: PromptInput {
            token_ids: Some(prompt(1_100, 256)),
            ..PromptInput::default()
        },
        ..SelectRequest::default()
    };
    c.bench_function("service/select/10_partitions_of_120/256", |b| {
        b.iter_batched(
            || request.clone(),
            |req| core.select(req).expect("selects").worker_id,
            BatchSize::SmallInput,
        )
    });
}

/// Catalog scalability: registering and removing one more worker in a partition that
/// already holds 1,000 or 10,000 (approximate mode, so no listener is started).
fn register(c: &mut Criterion) {
    let mut group = c.benchmark_group("service/register_and_delete");
    for workers in [1_000u64, 10_000] {
        let record = |w: u64| WorkerRequest {
            endpoint: Some(format!("http://w{w}")),
            block_size: Some(BLOCK),
            ..WorkerRequest::new(w)
        };
        // Built on first use: a filtered run of the other groups skips the 11,000
        // registrations.
        let mut core: Option<Arc<SelectionCore>> = None;
        group.bench_function(BenchmarkId::from_parameter(workers), |b| {
            let core = core.get_or_insert_with(|| {
                let core = SelectionCore::try_new_local(benches::seeded_config(false), None)
                    .expect("valid config");
                for w in 0..workers {
                    core.upsert_worker(record(w)).expect("worker registers");
                }
                core
            });
            b.iter(|| {
                core.upsert_worker(record(workers)).expect("registers");
                core.delete_worker(workers).expect("deletes")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, service, partitions, register);
criterion_main!(benches);
