//! A two-copy [`IndexCell`] against one plain index: every batch, applied whole to both
//! copies, leaves both answering every query like the plain index; and a lookup does not
//! wait for a writer held up inside its write, where a one-copy cell's lookup does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use kv_index::{IndexCell, IndexCopies, KvIndex, OverlapScores};
use kv_types::{KvOperation, StorageTier, WorkerId};
use proptest::prelude::*;

use crate::support::{cleared, q, removed, stored, w};

/// Worker, and what it does: store a chain of locals after an optional parent (engine
/// hash = local + 100), remove some hashes, or clear.
#[derive(Clone, Debug)]
enum Op {
    Store(u8, Option<u8>, Vec<u8>),
    Remove(u8, Vec<u8>),
    Clear(u8),
    RemoveWorker(u8),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..3, prop::option::of(0u8..6), prop::collection::vec(0u8..6, 1..5))
            .prop_map(|(wi, p, b)| Op::Store(wi, p, b)),
        2 => (0u8..3, prop::collection::vec(0u8..6, 1..3)).prop_map(|(wi, h)| Op::Remove(wi, h)),
        1 => (0u8..3).prop_map(Op::Clear),
        1 => (0u8..3).prop_map(Op::RemoveWorker),
    ]
}

fn operation(op: &Op) -> Option<KvOperation> {
    let key = |wi: u8| w(u64::from(wi), 0);
    Some(match op {
        Op::Store(wi, parent, locals) => {
            let pairs: Vec<(u64, u64)> = locals
                .iter()
                .map(|&l| (u64::from(l), u64::from(l) + 100))
                .collect();
            stored(
                key(*wi),
                StorageTier::Device,
                parent.map(|p| u64::from(p) + 100),
                &pairs,
            )
        }
        Op::Remove(wi, hashes) => {
            let hashes: Vec<u64> = hashes.iter().map(|&h| u64::from(h) + 100).collect();
            removed(key(*wi), &hashes)
        }
        Op::Clear(wi) => cleared(key(*wi)),
        Op::RemoveWorker(_) => return None,
    })
}

fn answers(index: &KvIndex, queries: &[Vec<u64>], out: &mut OverlapScores) -> Vec<Vec<(u64, u32)>> {
    queries
        .iter()
        .map(|query| {
            index.find_matches(&q(query), out);
            out.sort_by_worker();
            out.entries()
                .iter()
                .map(|e| (e.worker.worker_id.0, e.matched_blocks))
                .collect()
        })
        .collect()
}

proptest! {
    #[test]
    fn both_copies_answer_like_one_index(
        batches in prop::collection::vec(prop::collection::vec(op_strategy(), 1..6), 1..12),
        queries in prop::collection::vec(prop::collection::vec(0u64..6, 1..6), 1..8),
    ) {
        let cell = IndexCell::new(IndexCopies::Two, None, || KvIndex::with_block_size(4));
        let mut plain = KvIndex::with_block_size(4);
        let mut out = OverlapScores::new();
        for batch in &batches {
            let mut ops = Vec::new();
            for op in batch {
                if let Op::RemoveWorker(wi) = op {
                    // Not an event: the catalog's path, one write of its own.
                    cell.apply_batch(&ops);
                    for op in ops.drain(..) {
                        plain.apply(&op);
                    }
                    let id = WorkerId(u64::from(*wi));
                    cell.write(|index| index.remove_worker(id));
                    plain.remove_worker(id);
                } else {
                    ops.extend(operation(op));
                }
            }
            cell.apply_batch(&ops);
            for op in &ops {
                plain.apply(op);
            }
            let expect = answers(&plain, &queries, &mut out);
            // The published copy, then (after a write that changes nothing publishes it)
            // the other one.
            prop_assert_eq!(answers(&cell.read(), &queries, &mut out), expect.clone());
            cell.write(|_| ());
            prop_assert_eq!(answers(&cell.read(), &queries, &mut out), expect);
            prop_assert_eq!(cell.read().primary_stats(), plain.primary_stats());
            prop_assert_eq!(cell.read().counters(), plain.counters());
        }
        // One thread: no read can lose a try to a publication.
        prop_assert_eq!(cell.waits().reader_waits, 0);
    }
}

/// Holds a writer inside its change of the first copy (as if it lost its core there) and
/// runs a lookup meanwhile. Returns what the lookup saw of worker 2, or `None` when it
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
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let calls = Arc::new(AtomicU32::new(0));
    let writer = {
        let (cell, calls) = (Arc::clone(&cell), Arc::clone(&calls));
        thread::spawn(move || {
            cell.write(|index| {
                index.apply(&stored(
                    w(2, 0),
                    StorageTier::Device,
                    None,
                    &[(1, 11), (2, 12)],
                ));
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    entered_tx.send(()).expect("test alive");
                    // Bounded: the test releases it, or it gives up after 10 s.
                    let _ = release_rx.recv_timeout(Duration::from_secs(10));
                }
            });
        })
    };
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the writer entered its write");
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
    (during, calls.load(Ordering::SeqCst))
}

#[test]
fn a_two_copy_lookup_does_not_wait_for_a_held_writer_and_a_one_copy_lookup_does() {
    // Two copies: the lookup answers from the published copy, without worker 2's store,
    // while the writer is held; the writer then changes both copies.
    let (during, calls) = lookup_during_a_held_write(IndexCopies::Two, Duration::from_secs(10));
    assert_eq!(during, Some(0), "the two-copy lookup waited for the writer");
    assert_eq!(calls, 2);
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
                // Both copies of each cell (a write that changes nothing flips them).
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
/// batches, and a reader never sees a chain shrink (a copy is published only once it holds
/// every batch the other one did). Both copies hold every batch at the end.
#[test]
fn readers_see_whole_batches_that_never_go_back_while_two_writers_race() {
    const BATCHES: u64 = 400;
    let cell = Arc::new(IndexCell::new(IndexCopies::Two, None, || {
        KvIndex::with_block_size(16)
    }));
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
                while done.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < deadline {
                    for (worker, query) in queries.iter().enumerate() {
                        cell.read().find_matches(query, &mut out);
                        let m = out.score(w(worker as u64, 0));
                        assert_eq!(m % 4, 0, "a batch seen in part: {m} blocks");
                        assert!(m >= seen[worker], "went back from {} to {m}", seen[worker]);
                        seen[worker] = m;
                        reads += 1;
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
    let mut out = OverlapScores::new();
    for _ in 0..2 {
        for worker in 0..2u64 {
            cell.read().find_matches(&q(&chain(worker)), &mut out);
            assert_eq!(u64::from(out.score(w(worker, 0))), BATCHES * 4);
        }
        cell.write(|_| ());
    }
}
