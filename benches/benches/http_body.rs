//! The `POST /select` body fast path: cutting `token_ids` out of a compact JSON body and
//! parsing them (`select_server::split_token_ids`), for 2,048 and 32,768 ids below 150,000,
//! as `cargo xtask bench http` sends them. Throughput is per token id.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;

fn body(n: usize) -> Vec<u8> {
    let ids = benches::tokens(n, 11);
    let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    format!(r#"{{"model_name":"m","token_ids":[{list}],"expected_output_tokens":64}}"#).into_bytes()
}

fn http_body(c: &mut Criterion) {
    let mut group = c.benchmark_group("http_body");
    for n in [2_048usize, 32_768] {
        let bytes = body(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(
            BenchmarkId::new("split_token_ids", n),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    select_server::split_token_ids(black_box(bytes)).map(|(t, r)| t.len() + r.len())
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, http_body);
criterion_main!(benches);
