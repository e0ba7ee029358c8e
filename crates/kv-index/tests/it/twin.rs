//! A two-copy [`IndexCell`] (the index and its mirror) against one plain index: after
//! every batch, the mirror that lookups read answers every lookup like the plain index
//! (overlaps with the engine hashes they name, hint chains, tiered matches, stats and
//! counters), through removals, clears, removed workers, capacity evictions, lower tiers
//! and engines that hash the same tokens differently; and a lookup does not wait for a
//! writer held up inside its write, where a one-copy cell's lookup does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use kv_index::{
    IndexCell, IndexCopies, IndexWriter, KvIndex, MAX_HANDED_BATCHES, MAX_LEFT_BATCHES,
    OverlapScores, TieredMatches,
};
use kv_types::{ExternalHash, KvOperation, StorageTier, WorkerId, WorkerKey};
use proptest::prelude::*;

use crate::support::{cleared, q, removed, stored, w};

/// Worker, and what it does: store a chain of locals after an optional parent (on the
/// device or the host tier), remove some hashes, clear, leave, or declare a capacity.
#[derive(Clone, Debug)]
enum Op {
    Store(u8, Option<u8>, Vec<u8>, bool),
    Remove(u8, Vec<u8>),
    Clear(u8),
    RemoveWorker(u8),
    Capacity(u8, Option<u8>),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..4, prop::option::of(0u8..6), prop::collection::vec(0u8..6, 1..5), prop::bool::weighted(0.15))
            .prop_map(|(wi, p, b, host)| Op::Store(wi, p, b, host)),
        3 => (0u8..4, prop::collection::vec(0u8..6, 1..3)).prop_map(|(wi, h)| Op::Remove(wi, h)),
        1 => (0u8..4).prop_map(Op::Clear),
        1 => (0u8..4).prop_map(Op::RemoveWorker),
        1 => (0u8..4, prop::option::of(1u8..5)).prop_map(|(wi, c)| Op::Capacity(wi, c)),
    ]
}

/// The engine hash of `local` for worker `wi`: workers 0 and 1 agree (a fixed hash seed),
/// workers 2 and 3 each hash on their own (vLLM without one), so they name shared nodes
/// by hashes of their own.
fn ext(wi: u8, local: u8) -> u64 {
    let salt = if wi < 2 { 0 } else { u64::from(wi) * 1_000 };
    u64::from(local) + 100 + salt
}

fn key(wi: u8) -> WorkerKey {
    w(u64::from(wi), 0)
}

fn operation(op: &Op) -> Option<KvOperation> {
    Some(match op {
        Op::Store(wi, parent, locals, host) => {
            let pairs: Vec<(u64, u64)> = locals
                .iter()
                .map(|&l| (u64::from(l), ext(*wi, l)))
                .collect();
            let tier = if *host {
                StorageTier::HostPinned
            } else {
                StorageTier::Device
            };
            stored(key(*wi), tier, parent.map(|p| ext(*wi, p)), &pairs)
        }
        Op::Remove(wi, locals) => {
            let hashes: Vec<u64> = locals.iter().map(|&l| ext(*wi, l)).collect();
            removed(key(*wi), &hashes)
        }
        Op::Clear(wi) => cleared(key(*wi)),
        Op::RemoveWorker(_) | Op::Capacity(..) => return None,
    })
}

/// Applies `op` if it is one of the catalog's writes rather than an event.
fn catalog_write(op: &Op, index: &mut KvIndex) {
    match *op {
        Op::RemoveWorker(wi) => index.remove_worker(WorkerId(u64::from(wi))),
        Op::Capacity(wi, c) => {
            index.set_capacity(key(wi), c.map(u32::from));
        }
        _ => {}
    }
}

/// What every lookup answers: per query, the overlaps (worker, depth, last engine hash),
/// the hint chain in each worker's hashes and in the creators', and the tiered hits.
#[derive(Debug, PartialEq)]
struct Answers {
    overlaps: Vec<Vec<(u64, u32, u64)>>,
    chains: Vec<Vec<Vec<ExternalHash>>>,
    tiered: Vec<Vec<kv_index::TierHits>>,
}

fn answers(index: &KvIndex, queries: &[Vec<u64>]) -> Answers {
    let (mut out, mut tiered, mut chain) = (OverlapScores::new(), TieredMatches::new(), Vec::new());
    let mut all = Answers {
        overlaps: Vec::new(),
        chains: Vec::new(),
        tiered: Vec::new(),
    };
    for query in queries {
        index.find_matches(&q(query), &mut out);
        out.sort_by_worker();
        all.overlaps.push(
            out.entries()
                .iter()
                .map(|e| (e.worker.worker_id.0, e.matched_blocks, e.last_external.0))
                .collect(),
        );
        let mut chains = Vec::new();
        for holder in [None, Some(0), Some(2), Some(3)] {
            index.root_chain(&q(query), query.len(), holder.map(key), &mut chain);
            chains.push(chain.clone());
        }
        all.chains.push(chains);
        index.find_tiered(&q(query), &mut tiered);
        let mut hits = tiered.hits().to_vec();
        hits.sort_by_key(|h| h.worker);
        all.tiered.push(hits);
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn the_mirror_answers_every_lookup_like_one_index(
        batches in prop::collection::vec(prop::collection::vec(op_strategy(), 1..8), 1..14),
        queries in prop::collection::vec(prop::collection::vec(0u64..6, 1..6), 1..8),
    ) {
        for writer in [IndexWriter::Listeners, IndexWriter::Thread] {
            mirror_answers_like_one_index(writer, &batches, &queries)?;
        }
    }
}

/// `batches` applied to a two-copy cell whose batches `writer` applies, and to a plain
/// index: after each batch, lookups and cold reads of the cell answer `queries` as the
/// plain index does.
fn mirror_answers_like_one_index(
    writer: IndexWriter,
    batches: &[Vec<Op>],
    queries: &[Vec<u64>],
) -> Result<(), TestCaseError> {
    {
        let cell = IndexCell::with_writer(IndexCopies::Two, writer, None, || {
            KvIndex::with_block_size(4)
        })
        .expect("writer thread");
        let mut plain = KvIndex::with_block_size(4);
        for batch in batches {
            let mut ops = Vec::new();
            for op in batch {
                // Not events: the catalog's paths, each one write of its own.
                if matches!(op, Op::RemoveWorker(_) | Op::Capacity(..)) {
                    cell.apply_batch(&ops);
                    for op in ops.drain(..) {
                        plain.apply(&op);
                    }
                    cell.write(|index| catalog_write(op, index));
                    catalog_write(op, &mut plain);
                } else {
                    ops.extend(operation(op));
                }
            }
            cell.apply_batch(&ops);
            for op in &ops {
                plain.apply(op);
            }
            let expect = answers(&plain, queries);
            // A cold read waits for the writer thread to apply what was handed over; a
            // lookup sees it once that thread's turn is over.
            prop_assert_eq!(&answers(&cell.read_whole(), queries), &expect);
            cell.settle();
            prop_assert_eq!(&answers(&cell.read(), queries), &expect);
            prop_assert_eq!(cell.read().primary_stats(), plain.primary_stats());
            prop_assert_eq!(cell.read().counters(), plain.counters());
        }
        if writer == IndexWriter::Listeners {
            // One thread: no read can lose a try to a writer.
            prop_assert_eq!(cell.waits().reader_waits, 0);
        }
    }
    Ok(())
}

/// Starts a `cell.write` on another thread that applies `change` and then keeps the turn
/// (as if its writer lost its core there) until the returned sender sends, or 10 s pass;
/// returns once the write holds the turn.
fn hold_a_write(
    cell: &Arc<IndexCell>,
    change: impl FnOnce(&mut KvIndex) + Send + 'static,
) -> (thread::JoinHandle<()>, mpsc::Sender<()>) {
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let cell = Arc::clone(cell);
    let holder = thread::spawn(move || {
        cell.write(|index| {
            change(index);
            entered_tx.send(()).expect("test alive");
            // Bounded: the test releases it, or it gives up after 10 s.
            let _ = release_rx.recv_timeout(Duration::from_secs(10));
        });
    });
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the write took the turn");
    (holder, release)
}

/// Holds a writer inside its change (as if it lost its core there) and runs a lookup
/// meanwhile. Returns what the lookup saw of worker 2, or `None` when it
/// did not finish within `patience`; then releases the writer and returns after it.
fn lookup_during_a_held_write(copies: IndexCopies, patience: Duration) -> (Option<u32>, u32) {
    let cell = Arc::new(IndexCell::new(copies, None, || {
        KvIndex::with_block_size(16)
    }));
    cell.apply_batch(&[stored(
        w(1, 0),
        StorageTier::Device,
        None,
        &[(1, 11), (2, 12)],
    )]);
    let calls = Arc::new(AtomicU32::new(0));
    let (writer, release) = {
        let calls = Arc::clone(&calls);
        hold_a_write(&cell, move |index| {
            index.apply(&stored(
                w(2, 0),
                StorageTier::Device,
                None,
                &[(1, 11), (2, 12)],
            ));
            calls.fetch_add(1, Ordering::SeqCst);
        })
    };
    let (seen_tx, seen) = mpsc::channel();
    let reader = {
        let cell = Arc::clone(&cell);
        thread::spawn(move || {
            let mut out = OverlapScores::new();
            cell.read().find_matches(&q(&[1, 2]), &mut out);
            let _ = seen_tx.send(out.score(w(2, 0)));
        })
    };
    let during = seen.recv_timeout(patience).ok();
    release.send(()).expect("writer alive");
    writer.join().expect("writer");
    reader.join().expect("reader");
    let mut out = OverlapScores::new();
    cell.read().find_matches(&q(&[1, 2]), &mut out);
    assert_eq!(
        out.score(w(2, 0)),
        2,
        "{copies:?}: the write is read once done"
    );
    (during, calls.load(Ordering::SeqCst))
}

#[test]
fn a_two_copy_lookup_does_not_wait_for_a_held_writer_and_a_one_copy_lookup_does() {
    // Two copies: the lookup answers from the mirror, without worker 2's store, while the
    // writer is held; the writer then mirrors its change.
    let (during, calls) = lookup_during_a_held_write(IndexCopies::Two, Duration::from_secs(10));
    assert_eq!(during, Some(0), "the two-copy lookup waited for the writer");
    assert_eq!(calls, 1);
    // One copy: the lookup is still waiting after 200 ms (the writer holds the lock).
    let (during, calls) = lookup_during_a_held_write(IndexCopies::One, Duration::from_millis(200));
    assert_eq!(
        during, None,
        "the one-copy lookup read while the lock was held"
    );
    assert_eq!(calls, 1);
}

#[test]
fn moving_an_index_between_cells_keeps_its_answers_whatever_their_copies() {
    let all = [IndexCopies::One, IndexCopies::Two];
    for from in all {
        for into in all {
            let src = IndexCell::new(from, None, || KvIndex::with_block_size(16));
            let dst = IndexCell::new(into, None, || KvIndex::with_block_size(16));
            src.apply_batch(&[
                stored(
                    w(1, 0),
                    StorageTier::Device,
                    None,
                    &[(1, 11), (2, 12), (3, 13)],
                ),
                stored(w(2, 0), StorageTier::Device, None, &[(1, 11), (5, 15)]),
            ]);
            src.move_into(&dst, || KvIndex::with_block_size(16));
            let mut out = OverlapScores::new();
            for _ in 0..2 {
                // Before and after a write that changes nothing (and mirrors nothing).
                dst.read().find_matches(&q(&[1, 2, 3]), &mut out);
                assert_eq!(out.score(w(1, 0)), 3, "{from:?} into {into:?}");
                dst.read().find_matches(&q(&[1, 5]), &mut out);
                assert_eq!(out.score(w(2, 0)), 2, "{from:?} into {into:?}");
                src.read().find_matches(&q(&[1, 2, 3]), &mut out);
                assert!(out.is_empty(), "{from:?} into {into:?}");
                dst.write(|_| ());
                src.write(|_| ());
            }
        }
    }
}

/// Two writers extend their workers' chains a batch (two 2-block events) at a time, while
/// two readers query both chains for a bounded time: every answer is a whole number of
/// batches, and a reader never sees a chain shrink (lookups read the index only while the
/// mirror is locked to catch up with it). Both copies hold every batch at the end.
#[test]
fn readers_see_whole_batches_that_never_go_back_while_two_writers_race() {
    batches_race(IndexWriter::Listeners);
}

/// The same with a writer thread: the two listeners hand their batches over, and it
/// applies them.
#[test]
fn readers_see_whole_batches_that_never_go_back_while_two_listeners_hand_them_over() {
    batches_race(IndexWriter::Thread);
}

fn batches_race(writer: IndexWriter) {
    const BATCHES: u64 = 400;
    let cell = Arc::new(
        IndexCell::with_writer(IndexCopies::Two, writer, None, || {
            KvIndex::with_block_size(16)
        })
        .expect("writer thread"),
    );
    let chain =
        |worker: u64| -> Vec<u64> { (0..BATCHES * 4).map(|i| worker * 10_000 + i).collect() };
    let done = Arc::new(AtomicU32::new(0));
    let writers: Vec<_> = (0..2u64)
        .map(|worker| {
            let (cell, done) = (Arc::clone(&cell), Arc::clone(&done));
            let locals = chain(worker);
            thread::spawn(move || {
                for b in 0..BATCHES as usize {
                    let ops: Vec<KvOperation> = (0..2)
                        .map(|e| {
                            let at = b * 4 + e * 2;
                            let pairs: Vec<(u64, u64)> =
                                locals[at..at + 2].iter().map(|&l| (l, l + 1)).collect();
                            let parent = at.checked_sub(1).map(|p| locals[p] + 1);
                            stored(w(worker, 0), StorageTier::Device, parent, &pairs)
                        })
                        .collect();
                    cell.apply_batch(&ops);
                }
                done.fetch_add(1, Ordering::SeqCst);
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (cell, done) = (Arc::clone(&cell), Arc::clone(&done));
            let queries = [q(&chain(0)), q(&chain(1))];
            thread::spawn(move || {
                let mut out = OverlapScores::new();
                let mut seen = [0u32; 2];
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                let mut reads = 0u64;
                // At least one round, however soon the writers are done.
                loop {
                    for (worker, query) in queries.iter().enumerate() {
                        cell.read().find_matches(query, &mut out);
                        let m = out.score(w(worker as u64, 0));
                        assert_eq!(m % 4, 0, "a batch seen in part: {m} blocks");
                        assert!(m >= seen[worker], "went back from {} to {m}", seen[worker]);
                        seen[worker] = m;
                        reads += 1;
                    }
                    if done.load(Ordering::SeqCst) >= 2 || std::time::Instant::now() >= deadline {
                        break;
                    }
                }
                reads
            })
        })
        .collect();
    for writer in writers {
        writer.join().expect("writer");
    }
    for reader in readers {
        assert!(reader.join().expect("reader") > 0);
    }
    if writer == IndexWriter::Thread {
        cell.settle();
    }
    let mut out = OverlapScores::new();
    for _ in 0..2 {
        for worker in 0..2u64 {
            cell.read().find_matches(&q(&chain(worker)), &mut out);
            assert_eq!(u64::from(out.score(w(worker, 0))), BATCHES * 4);
        }
        cell.write(|_| ());
    }
}

/// A listener batch that finds the turn taken by another write (held here inside a
/// catalog write) is left to that writer: its `apply_batch` returns while the write is
/// held, and the batch is in the index, and mirrored, once the write returns.
#[test]
fn a_batch_left_while_a_write_holds_the_turn_is_applied_when_that_write_ends() {
    let cell = Arc::new(IndexCell::new(IndexCopies::Two, None, || {
        KvIndex::with_block_size(16)
    }));
    let (holder, release) = hold_a_write(&cell, |index| {
        index.apply(&stored(w(1, 0), StorageTier::Device, None, &[(1, 11)]));
    });
    let (left_tx, left) = mpsc::channel();
    let listener = {
        let cell = Arc::clone(&cell);
        thread::spawn(move || {
            cell.apply_batch(&[stored(
                w(2, 0),
                StorageTier::Device,
                None,
                &[(1, 11), (2, 12)],
            )]);
            let _ = left_tx.send(());
        })
    };
    let returned = left.recv_timeout(Duration::from_secs(10)).is_ok();
    let mut out = OverlapScores::new();
    cell.read().find_matches(&q(&[1, 2]), &mut out);
    let seen_while_held = out.score(w(2, 0));
    release.send(()).expect("holder alive");
    holder.join().expect("holder");
    listener.join().expect("listener");
    assert!(returned, "the listener waited for the turn");
    assert_eq!(seen_while_held, 0);
    cell.read().find_matches(&q(&[1, 2]), &mut out);
    assert_eq!((out.score(w(1, 0)), out.score(w(2, 0))), (1, 2));
}

/// Batches left for a writer that holds the turn are bounded: a listener that finds
/// [`MAX_LEFT_BATCHES`] of them waits for the turn, and so feels the index's pace, as with
/// one copy.
#[test]
fn a_bounded_number_of_batches_waits_for_a_writer_that_holds_the_turn() {
    let cell = Arc::new(IndexCell::new(IndexCopies::Two, None, || {
        KvIndex::with_block_size(16)
    }));
    at_most_bound_batches_wait(&cell, MAX_LEFT_BATCHES as u32, false);
}

/// While a catalog write holds `cell`'s turn, a listener hands over `bound` batches of a
/// chain and then waits; once the turn is free, the whole chain is applied in order (by
/// the time the listener returns, or, with a writer thread, once the cell has settled).
fn at_most_bound_batches_wait(cell: &Arc<IndexCell>, bound: u32, settle: bool) {
    let (holder, release) = hold_a_write(cell, |_| ());
    let returned = Arc::new(AtomicU32::new(0));
    let listener = {
        let (cell, returned) = (Arc::clone(cell), Arc::clone(&returned));
        thread::spawn(move || {
            for i in 0..u64::from(bound) + 8 {
                let parent = i.checked_sub(1).map(|p| p + 100);
                cell.apply_batch(&[stored(
                    w(2, 0),
                    StorageTier::Device,
                    parent,
                    &[(i, i + 100)],
                )]);
                returned.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while returned.load(Ordering::SeqCst) < bound && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        returned.load(Ordering::SeqCst),
        bound,
        "more batches waiting than the bound"
    );
    release.send(()).expect("holder alive");
    holder.join().expect("holder");
    listener.join().expect("listener");
    if settle {
        cell.settle();
    }
    let mut out = OverlapScores::new();
    let chain: Vec<u64> = (0..u64::from(bound) + 8).collect();
    cell.read().find_matches(&q(&chain), &mut out);
    assert_eq!(out.score(w(2, 0)), bound + 8);
}

/// A two-copy cell with a writer thread.
fn threaded_cell() -> Arc<IndexCell> {
    Arc::new(
        IndexCell::with_writer(IndexCopies::Two, IndexWriter::Thread, None, || {
            KvIndex::with_block_size(16)
        })
        .expect("writer thread"),
    )
}

/// What a lookup of chain `1, 2` finds of worker 2.
fn worker_2_on_1_2(cell: &IndexCell) -> u32 {
    let mut out = OverlapScores::new();
    cell.read().find_matches(&q(&[1, 2]), &mut out);
    out.score(w(2, 0))
}

/// A listener hands its batch to the writer thread and returns without waiting for the
/// turn, even while a catalog write holds it; the thread applies the batch without any
/// further call, once the turn is free.
#[test]
fn the_writer_thread_applies_a_handed_batch_on_its_own() {
    let cell = threaded_cell();
    cell.apply_batch(&[stored(w(2, 0), StorageTier::Device, None, &[(1, 11)])]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while worker_2_on_1_2(&cell) < 1 && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        worker_2_on_1_2(&cell),
        1,
        "the writer thread applied nothing"
    );

    let (holder, release) = hold_a_write(&cell, |_| ());
    let (returned_tx, returned) = mpsc::channel();
    let listener = {
        let cell = Arc::clone(&cell);
        thread::spawn(move || {
            cell.apply_batch(&[stored(w(2, 0), StorageTier::Device, Some(11), &[(2, 12)])]);
            let _ = returned_tx.send(());
        })
    };
    let handed = returned.recv_timeout(Duration::from_secs(10)).is_ok();
    let seen_while_held = worker_2_on_1_2(&cell);
    release.send(()).expect("holder alive");
    holder.join().expect("holder");
    listener.join().expect("listener");
    assert!(handed, "the listener waited for the turn");
    assert_eq!(seen_while_held, 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while worker_2_on_1_2(&cell) < 2 && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(worker_2_on_1_2(&cell), 2);
}

/// A cold read waits for the batches handed over before it (the writer thread cannot
/// apply them while a catalog write holds the turn), and then finds them.
#[test]
fn a_cold_read_waits_for_the_batches_handed_over_before_it() {
    let cell = threaded_cell();
    let (holder, release) = hold_a_write(&cell, |_| ());
    cell.apply_batch(&[stored(
        w(2, 0),
        StorageTier::Device,
        None,
        &[(1, 11), (2, 12)],
    )]);
    let (read_tx, read) = mpsc::channel();
    let reader = {
        let cell = Arc::clone(&cell);
        thread::spawn(move || {
            let index = cell.read_whole();
            let _ = read_tx.send(index.primary().holds(w(2, 0), &q(&[1, 2])));
        })
    };
    let early = read.recv_timeout(Duration::from_millis(100));
    release.send(()).expect("holder alive");
    holder.join().expect("holder");
    let held = read.recv_timeout(Duration::from_secs(10));
    assert!(
        early.is_err(),
        "the cold read did not wait for the handed batch"
    );
    assert_eq!(held, Ok(true));
    reader.join().expect("reader");
}

/// Batches handed to a writer thread that cannot take the turn are bounded: the listener
/// waits once [`MAX_HANDED_BATCHES`] wait, and every batch is applied in order once the
/// turn is free.
#[test]
fn a_bounded_number_of_batches_waits_for_the_writer_thread() {
    at_most_bound_batches_wait(&threaded_cell(), MAX_HANDED_BATCHES as u32, true);
}

/// A listener's own vector handed to a writer thread is kept, not copied; in exchange the
/// listener gets a vector of operations the thread has applied (the batch it handed over
/// before), to empty and reuse. Any other cell applies the batch and leaves the vector.
#[test]
fn a_writer_thread_keeps_a_listeners_vector_and_gives_back_an_applied_one() {
    let cell = threaded_cell();
    let first = stored(w(2, 0), StorageTier::Device, None, &[(1, 11)]);
    let mut ops = vec![first.clone()];
    cell.apply_batch_owned(&mut ops);
    assert!(
        ops.is_empty(),
        "kept, with nothing applied yet to give back"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while worker_2_on_1_2(&cell) < 1 && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    let mut ops = vec![stored(w(2, 0), StorageTier::Device, Some(11), &[(2, 12)])];
    cell.apply_batch_owned(&mut ops);
    assert_eq!(ops, vec![first], "the applied batch comes back");
    cell.settle();
    assert_eq!(worker_2_on_1_2(&cell), 2);

    for copies in [IndexCopies::One, IndexCopies::Two] {
        let cell = IndexCell::new(copies, None, || KvIndex::with_block_size(16));
        let batch = vec![stored(
            w(2, 0),
            StorageTier::Device,
            None,
            &[(1, 11), (2, 12)],
        )];
        let mut ops = batch.clone();
        cell.apply_batch_owned(&mut ops);
        assert_eq!(ops, batch, "{copies:?}");
        assert_eq!(worker_2_on_1_2(&cell), 2, "{copies:?}");
    }
}
