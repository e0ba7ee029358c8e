//! End-to-end replica-sync propagation latency on loopback (`replica-sync.md`): two
//! in-process `SelectionService`s meshed over ZMQ on 127.0.0.1, the same 8 workers
//! registered on both. Each of 10,000 bookings is made on A with `select_and_reserve` (a
//! 512-token prompt, so 32 tracking hashes travel) and timed from just before the call until
//! B's receiver has booked the mirror into B's ledger (B's `applied` counter moves, which
//! happens after the ledger write); the booking is then freed on A and the free awaited on B
//! the same way, so B's ledger never grows. A second phase sends bursts of 250 bookings and
//! then their 250 frees, each burst awaited on B, for a sustained events/s. 500 events in
//! flight stay below ZMQ's default high-water mark of 1,000 messages per subscriber (the
//! spec keeps the library default); bursts of 1,000 were seen to lose a couple of events,
//! which the spec allows (best effort) but which would make the rate meaningless.
//!
//! Not a criterion bench: the quantity is a distribution of one-shot latencies across two
//! threads, not the mean of a closed loop. Run with
//! `cargo bench -p benches --bench replica_propagation`.

#![expect(
    clippy::print_stdout,
    reason = "a harness-less bench reports on stdout"
)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use service_builder::{
    PromptInput, ReplicaSyncConfig, SelectRequest, SelectionCore, SelectionService,
    SelectionServiceBuilder, WorkerRequest,
};

const BOOKINGS: usize = 10_000;
const WORKERS: u64 = 8;
const BURST: usize = 250;
/// A booking that has not arrived after this long is counted as lost, not waited for.
const LOST_AFTER: Duration = Duration::from_secs(1);

use testkit::free_port;

/// `Some((port, peer))` meshes the service with one peer; `None` is the local-only baseline.
fn service(mesh: Option<(u16, u16)>) -> SelectionService {
    let config = benches::seeded_config(false);
    let mut builder = SelectionServiceBuilder::new(config);
    if let Some((port, peer)) = mesh {
        builder = builder.replica_sync(ReplicaSyncConfig {
            host: "127.0.0.1".into(),
            port: Some(port),
            peers: vec![format!("tcp://127.0.0.1:{peer}")],
        });
    }
    let service = builder.build().expect("service starts");
    for w in 0..WORKERS {
        service
            .core()
            .upsert_worker(WorkerRequest {
                endpoint: Some(format!("http://w{w}")),
                block_size: Some(16),
                ..WorkerRequest::new(w)
            })
            .expect("worker registers");
    }
    service
}

fn applied(core: &SelectionCore) -> u64 {
    core.replica_stats().applied.load(Ordering::Acquire)
}

/// Spins (yielding: the receiver thread needs the core on a 2-core machine) until B has
/// applied `target` events; `false` after [`LOST_AFTER`].
fn await_applied(core: &SelectionCore, target: u64, limit: Duration) -> bool {
    let start = Instant::now();
    let mut spins = 0u32;
    while applied(core) < target {
        spins += 1;
        if spins.is_multiple_of(1024) && start.elapsed() > limit {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

fn active(core: &SelectionCore) -> u64 {
    core.loads(None, None)
        .iter()
        .flat_map(|m| &m.loads)
        .map(|r| r.active_requests)
        .sum()
}

fn request(id: String, tokens: &[u32]) -> SelectRequest {
    SelectRequest {
        selection_id: Some(id),
        prompt: PromptInput {
            token_ids: Some(tokens.to_vec()),
            ..PromptInput::default()
        },
        ..SelectRequest::default()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(what: &str, samples: &mut [Duration]) {
    samples.sort_unstable();
    if samples.is_empty() {
        println!("{what}: no samples");
        return;
    }
    println!(
        "{what}: n={} p50={:.1} µs p90={:.1} µs p99={:.1} µs p99.9={:.1} µs max={:.1} µs",
        samples.len(),
        percentile(samples, 0.50).as_secs_f64() * 1e6,
        percentile(samples, 0.90).as_secs_f64() * 1e6,
        percentile(samples, 0.99).as_secs_f64() * 1e6,
        percentile(samples, 0.999).as_secs_f64() * 1e6,
        samples[samples.len() - 1].as_secs_f64() * 1e6,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing: then run a
    // short smoke version so the target is still exercised without taking long.
    let full = std::env::args().any(|a| a == "--bench");
    let bookings = if full { BOOKINGS } else { 100 };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let _guard = runtime.enter();
    let (pa, pb) = (free_port(), free_port());
    let a = service(Some((pa, pb)));
    let b = service(Some((pb, pa)));
    let (a, b) = (a.core(), b.core());
    let tokens = benches::tokens(512, 7);

    // Slow joiner: B's subscription reaches A's PUB socket some time after connect.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut probe = 0u64;
    loop {
        let base = applied(b);
        probe += 1;
        let id = format!("probe-{probe}");
        a.select_and_reserve(request(id.clone(), &tokens))
            .expect("probe books");
        let seen = await_applied(b, base + 1, Duration::from_millis(50));
        a.free_reservation(&id).expect("probe frees");
        if seen {
            break;
        }
        assert!(Instant::now() < deadline, "B never received A's bookings");
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(active(b), 0, "probe frees settled on B");

    let mut book_latency = Vec::with_capacity(bookings);
    let mut local_book = Vec::with_capacity(bookings);
    let mut after_return = Vec::with_capacity(bookings);
    let mut free_latency = Vec::with_capacity(bookings);
    let mut lost = 0usize;
    let run = Instant::now();
    for i in 0..bookings {
        let id = format!("bk-{i}");
        let req = request(id.clone(), &tokens);
        let base = applied(b);
        let t0 = Instant::now();
        a.select_and_reserve(req).expect("books on A");
        let t_local = t0.elapsed();
        if !await_applied(b, base + 1, LOST_AFTER) {
            lost += 1;
            a.free_reservation(&id).expect("frees on A");
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        let total = t0.elapsed();
        book_latency.push(total);
        local_book.push(t_local);
        after_return.push(total.saturating_sub(t_local));
        if i % 1000 == 0 {
            assert_eq!(active(b), 1, "B's ledger shows the booking");
        }
        let t1 = Instant::now();
        a.free_reservation(&id).expect("frees on A");
        if await_applied(b, base + 2, LOST_AFTER) {
            free_latency.push(t1.elapsed());
        } else {
            lost += 1;
        }
    }
    let elapsed = run.elapsed();
    println!("replica propagation A→B on 127.0.0.1, {bookings} bookings one at a time:");
    report("  book on A → mirrored in B's ledger", &mut book_latency);
    report("  free on A → freed in B's ledger   ", &mut free_latency);
    report("  select_and_reserve on A (local)   ", &mut local_book);
    report("  mirrored in B after A's call returned", &mut after_return);
    println!(
        "  lost: {lost}; round trips: {:.0} events/s ({} events in {:.2} s)",
        (2 * bookings) as f64 / elapsed.as_secs_f64(),
        2 * bookings,
        elapsed.as_secs_f64()
    );

    // Sustained: bursts of BURST bookings, then their frees, each burst awaited on B.
    let rounds = bookings / BURST.min(bookings);
    let burst = bookings / rounds;
    let start = Instant::now();
    let mut burst_lost = 0u64;
    for r in 0..rounds {
        let base = applied(b);
        for i in 0..burst {
            a.select_and_reserve(request(format!("burst-{r}-{i}"), &tokens))
                .expect("books on A");
        }
        for i in 0..burst {
            a.free_reservation(&format!("burst-{r}-{i}"))
                .expect("frees on A");
        }
        let target = base + 2 * burst as u64;
        if !await_applied(b, target, LOST_AFTER) {
            let missing = target - applied(b);
            println!("  round {r}: {missing} events missing after {LOST_AFTER:?}");
            burst_lost += missing;
        }
    }
    let elapsed = start.elapsed();
    let events = (2 * burst * rounds) as u64;
    println!(
        "  bursts of {burst} bookings + {burst} frees: {:.0} events/s applied on B ({events} events in {:.2} s, lost {burst_lost})",
        (events - burst_lost) as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    // Baseline: the same bookings on a service without replica sync, to split the
    // local cost of publishing (encode + enqueue + waking the publisher) from the rest.
    let solo = service(None);
    let mut solo_book = Vec::with_capacity(bookings);
    for i in 0..bookings {
        let req = request(format!("solo-{i}"), &tokens);
        let t0 = Instant::now();
        solo.core().select_and_reserve(req).expect("books");
        solo_book.push(t0.elapsed());
        solo.core()
            .free_reservation(&format!("solo-{i}"))
            .expect("frees");
    }
    report("  select_and_reserve, no replica sync", &mut solo_book);
    println!("  warm-up probes: {probe} (their events may predate B's subscription)");
    for (name, core) in [("A", a), ("B", b)] {
        if let Some(stats) = core.replica_mesh_stats() {
            println!("  {name} mesh stats: {stats:?}");
        }
    }
    println!(
        "  B applied {} events; dropped by reason: {:?}",
        applied(b),
        b.replica_stats().dropped_rows()
    );
}
