//! Writers and readers on one shared index for a bounded time: every answer is a prefix
//! some worker really stored (never longer than anything ever stored for it), and a store
//! applied in pieces is only ever seen in whole pieces, even while its worker is removed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use kv_index::{KvIndex, OverlapScores, STORE_PIECE_BLOCKS, SharedKvIndex};
use kv_types::{StorageTier, WorkerId};

use crate::support::{cleared, q, removed, stored, w};

const CHAIN: u64 = 24;

/// Worker `i` stores (and removes, and clears) prefixes of the chain `i*100 + 0..CHAIN`
/// after a shared head block 7. Nothing else is ever stored.
#[test]
fn readers_never_see_more_than_was_stored() {
    let index = Arc::new(SharedKvIndex::new(KvIndex::with_block_size(16)));
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_millis(600);
    let mut handles = Vec::new();
    for writer in 0..3u64 {
        let index = Arc::clone(&index);
        let stop = Arc::clone(&stop);
        handles.push(thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) && round < 1_000_000 {
                for worker in (writer * 4)..(writer * 4 + 4) {
                    let key = w(worker, 0);
                    let len = 1 + (round * 7 + worker) % CHAIN;
                    let pairs: Vec<(u64, u64)> = std::iter::once((7, 7_000_000 + worker))
                        .chain((0..len).map(|i| (worker * 100 + i, worker * 1000 + i)))
                        .collect();
                    index.apply(&stored(key, StorageTier::Device, None, &pairs));
                    match round % 3 {
                        0 => {
                            index.apply(&removed(key, &[worker * 1000 + len / 2]));
                        }
                        1 => {
                            index.apply(&cleared(key));
                        }
                        _ => {}
                    }
                }
                round += 1;
            }
        }));
    }
    let mut readers = Vec::new();
    for reader in 0..3u64 {
        let index = Arc::clone(&index);
        let stop = Arc::clone(&stop);
        readers.push(thread::spawn(move || {
            let mut out = OverlapScores::new();
            let mut checked = 0u64;
            let mut i = reader;
            while !stop.load(Ordering::Relaxed) && checked < 10_000_000 {
                let worker = i % 12;
                let mut prompt = vec![7];
                prompt.extend((0..CHAIN + 2).map(|k| worker * 100 + k));
                index.find_matches(&q(&prompt), &mut out);
                for e in out.entries() {
                    let id = e.worker.worker_id.0;
                    assert!(id < 12, "unknown worker {id}");
                    if id == worker {
                        assert!(u64::from(e.matched_blocks) <= CHAIN + 1);
                    } else {
                        // Other workers only share the head block.
                        assert_eq!(e.matched_blocks, 1);
                    }
                }
                checked += 1;
                i += 1;
            }
            checked
        }));
    }
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let checked: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(checked > 0);
}

/// Workers 0..6 store long chains (three pieces and a tail, so `SharedKvIndex::apply` splits
/// them) whose first piece is shared by all of them, and clear them again; a "catalog"
/// thread removes workers at arbitrary moments. Readers check on every answer that each
/// worker's match is a whole number of pieces or its whole chain (a reader never sees half
/// of a piece, and a removal between two pieces leaves no tail behind, since the next piece
/// finds its parent gone). At the end the index must be empty once every worker is removed.
#[test]
fn pieced_stores_are_seen_in_whole_pieces_while_workers_come_and_go() {
    const WORKERS: u64 = 6;
    let piece = STORE_PIECE_BLOCKS as u64;
    let chain_len = move |worker: u64| 3 * piece + 1 + worker;
    let index = Arc::new(SharedKvIndex::new(KvIndex::with_block_size(16)));
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_millis(800);
    let mut writers = Vec::new();
    for writer in 0..2u64 {
        let index = Arc::clone(&index);
        let stop = Arc::clone(&stop);
        writers.push(thread::spawn(move || {
            for round in 0..20_000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                for worker in (writer..WORKERS).step_by(2) {
                    let key = w(worker, 0);
                    // Locals: a piece shared by every worker, then the worker's own.
                    let pairs: Vec<(u64, u64)> = (0..chain_len(worker))
                        .map(|i| {
                            let local = if i < piece { i } else { worker * 1_000 + i };
                            (local, worker * 1_000_000 + i)
                        })
                        .collect();
                    index.apply(&stored(key, StorageTier::Device, None, &pairs));
                    if round % 2 == 0 {
                        index.apply(&cleared(key));
                    }
                }
            }
        }));
    }
    let catalog = {
        let index = Arc::clone(&index);
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            for k in 0..1_000_000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                index.remove_worker(WorkerId(k % WORKERS));
                thread::yield_now();
            }
        })
    };
    let mut readers = Vec::new();
    for reader in 0..2u64 {
        let index = Arc::clone(&index);
        let stop = Arc::clone(&stop);
        readers.push(thread::spawn(move || {
            let mut out = OverlapScores::new();
            let mut checked = 0u64;
            while !stop.load(Ordering::Relaxed) && checked < 1_000_000 {
                let worker = (reader + checked) % WORKERS;
                let prompt: Vec<u64> = (0..chain_len(worker) + 2)
                    .map(|i| if i < piece { i } else { worker * 1_000 + i })
                    .collect();
                index.find_matches(&q(&prompt), &mut out);
                for e in out.entries() {
                    let id = e.worker.worker_id.0;
                    let m = u64::from(e.matched_blocks);
                    assert!(id < WORKERS, "unknown worker {id}");
                    if id == worker {
                        assert!(
                            m == chain_len(id) || (m % piece == 0 && m < chain_len(id)),
                            "worker {id} matched {m} blocks: part of a piece"
                        );
                    } else {
                        // Other workers share exactly the first piece.
                        assert_eq!(m, piece, "worker {id} beyond the shared piece");
                    }
                }
                checked += 1;
            }
            checked
        }));
    }
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for h in writers {
        h.join().unwrap();
    }
    catalog.join().unwrap();
    let checked: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(checked > 0);
    for worker in 0..WORKERS {
        index.remove_worker(WorkerId(worker));
    }
    let stats = index.read(|i| i.primary_stats());
    assert_eq!((stats.nodes, stats.memberships, stats.workers), (0, 0, 0));
}

/// A batch applied in shared sections (`apply_batch_fairly`, what the listeners use) leaves
/// the index exactly as its operations applied one at a time: small stores grouped into one
/// section, a store longer than a section in pieces of its own, removals, a clear, stores
/// hanging from blocks of earlier sections, and a store whose parent is unknown.
#[test]
fn a_batch_in_sections_equals_its_operations_one_by_one() {
    let long: Vec<(u64, u64)> = (0..(2 * STORE_PIECE_BLOCKS as u64 + 5))
        .map(|i| (5_000 + i, 50_000 + i))
        .collect();
    let mut ops = Vec::new();
    for k in 0..40u64 {
        // Chains of 8 blocks under a shared head: 40 stores span several sections.
        let pairs: Vec<(u64, u64)> = (0..8).map(|i| (1_000 * k + i, 10_000 * k + i)).collect();
        ops.push(stored(w(k % 3, 0), StorageTier::Device, None, &pairs));
        if k % 5 == 4 {
            ops.push(removed(w(k % 3, 0), &[10_000 * k + 7, 10_000 * k + 6]));
        }
    }
    ops.push(stored(w(1, 0), StorageTier::Device, Some(10_000), &long));
    ops.push(stored(
        w(2, 0),
        StorageTier::Device,
        Some(50_000 + 200),
        &[(9, 90)],
    ));
    ops.push(cleared(w(0, 0)));
    ops.push(stored(
        w(0, 0),
        StorageTier::Device,
        Some(424_242),
        &[(1, 2)],
    ));
    ops.push(stored(w(0, 0), StorageTier::HostPinned, None, &[(3, 4)]));

    let one_by_one = SharedKvIndex::new(KvIndex::with_block_size(16));
    for op in &ops {
        one_by_one.apply(op);
    }
    // Without stepping aside, and stepping aside at every section boundary (an interval
    // of zero): the writer releases the lock and yields between sections.
    for (step_aside, stepped) in [(None, false), (Some(std::time::Duration::ZERO), true)] {
        let sections = parking_lot::RwLock::new(KvIndex::with_block_size(16));
        let gate = kv_index::ReadGate::with_step_aside(step_aside);
        kv_index::apply_batch_fairly(&sections, &parking_lot::Mutex::new(()), &gate, &ops);
        let steps = gate.counts().step_asides;
        // 40 stores of 8 blocks fill at least 10 sections of 32.
        assert_eq!(steps >= 9, stepped, "{step_aside:?}: {steps} step-asides");
        let sections = sections.into_inner();
        assert_eq!(sections.counters(), one_by_one.counters());
        assert_eq!(
            sections.snapshot_operations(),
            one_by_one.snapshot_operations()
        );
        assert!(
            sections.counters().stored_ok > 40,
            "{:?}",
            sections.counters()
        );
    }
}

/// Listener threads writing one partition at once through the writers' turn: every batch
/// lands whole, as if the batches (of distinct workers) were applied one after another,
/// while a reader keeps looking up.
#[test]
fn concurrent_batch_writers_take_turns() {
    let index = Arc::new(parking_lot::RwLock::new(KvIndex::with_block_size(16)));
    let writers = Arc::new(parking_lot::Mutex::new(()));
    // Writers that step aside every few microseconds: the lock changes hands between
    // sections that way too.
    let gate = Arc::new(kv_index::ReadGate::with_step_aside(Some(
        std::time::Duration::from_micros(5),
    )));
    let batch = |worker: u64, k: u64| -> Vec<kv_types::KvOperation> {
        (0..32u64)
            .map(|e| {
                let base = worker * 1_000_000 + k * 1_000 + e * 10;
                let pairs: Vec<(u64, u64)> = (0..8).map(|i| (base + i, base + i)).collect();
                stored(w(worker, 0), StorageTier::Device, None, &pairs)
            })
            .collect()
    };
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (index, done, gate) = (Arc::clone(&index), Arc::clone(&done), Arc::clone(&gate));
        thread::spawn(move || {
            let mut out = OverlapScores::new();
            let deadline = Instant::now() + Duration::from_secs(10);
            while !done.load(Ordering::Acquire) && Instant::now() < deadline {
                gate.read(&index)
                    .find_matches(&q(&[1_000_000, 1_000_001]), &mut out);
            }
        })
    };
    let threads: Vec<_> = (1..=4u64)
        .map(|worker| {
            let (index, writers, gate) =
                (Arc::clone(&index), Arc::clone(&writers), Arc::clone(&gate));
            thread::spawn(move || {
                for k in 0..20 {
                    kv_index::apply_batch_fairly(&index, &writers, &gate, &batch(worker, k));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    done.store(true, Ordering::Release);
    reader.join().unwrap();
    let sequential = SharedKvIndex::new(KvIndex::with_block_size(16));
    for worker in 1..=4u64 {
        for k in 0..20 {
            for op in &batch(worker, k) {
                sequential.apply(op);
            }
        }
    }
    let index = index.read();
    assert_eq!(index.counters(), sequential.counters());
    // Snapshot event ids count emissions, so they follow the trie's order: compare the rest.
    let rest = |ops: Vec<kv_types::KvOperation>| {
        let mut v: Vec<String> = ops
            .into_iter()
            .map(|op| format!("{:?} {:?} {:?}", op.worker, op.tier, op.kind))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        rest(index.snapshot_operations()),
        rest(sequential.snapshot_operations())
    );
}
