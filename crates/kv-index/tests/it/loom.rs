//! loom model of the pieced, fairly unlocked store (`apply_fairly` in `src/shared.rs`),
//! compiled only with `--cfg loom`; run by `cargo xtask loom`.
//!
//! `apply_fairly` takes a `parking_lot::RwLock`, which loom cannot schedule, so the model
//! replicates its loop on loom's `RwLock` around the real [`KvIndex`] (the index itself does
//! no synchronization: every piece is the real `apply_stored_piece`). Keep the replica in
//! step with `src/shared.rs`. The fair unlock is not modeled: fairness is a liveness
//! property, loom checks the states readers can observe.
//!
//! Invariants: a reader never observes part of a piece — a worker's match of the stored
//! chain is a whole number of pieces or the whole chain, never longer than what was stored
//! — and a worker removed between two pieces keeps nothing of the store (the next piece
//! finds its parent gone), so the end state is all of the chain or none of it.

use kv_index::{ApplyOutcome, KvIndex, OverlapScores, STORE_PIECE_BLOCKS};
use kv_types::{KvOperation, KvOperationKind, StorageTier, WorkerId};
use loom::sync::{Arc, RwLock};
use loom::thread;

use crate::support::{q, stored, w};

/// Three pieces: two whole ones and a single block.
const CHAIN: usize = 2 * STORE_PIECE_BLOCKS + 1;

/// `apply_fairly` on loom's lock.
fn apply_fairly(index: &RwLock<KvIndex>, op: &KvOperation) -> ApplyOutcome {
    if let KvOperationKind::Stored {
        parent_hash,
        blocks,
    } = &op.kind
        && op.tier.is_device()
        && blocks.len() > STORE_PIECE_BLOCKS
    {
        let mut parent = *parent_hash;
        let mut first = ApplyOutcome::Ok;
        for (i, piece) in blocks.chunks(STORE_PIECE_BLOCKS).enumerate() {
            let mut guard = index.write().unwrap();
            let outcome = guard.apply_stored_piece(op.worker, parent, piece, i == 0);
            drop(guard);
            if i == 0 {
                first = outcome;
            }
            if outcome == ApplyOutcome::ParentBlockNotFound {
                break;
            }
            parent = piece.last().map(|b| b.block_hash);
        }
        return first;
    }
    index.write().unwrap().apply(op)
}

fn chain_op(worker: u64, len: usize) -> KvOperation {
    let pairs: Vec<(u64, u64)> = (0..len as u64).map(|i| (i, worker * 10_000 + i)).collect();
    stored(w(worker, 0), StorageTier::Device, None, &pairs)
}

fn matched(index: &RwLock<KvIndex>, worker: u64) -> usize {
    let query = q(&(0..CHAIN as u64 + 1).collect::<Vec<_>>());
    let mut out = OverlapScores::new();
    index.read().unwrap().find_matches(&query, &mut out);
    out.score(w(worker, 0)) as usize
}

fn assert_whole_pieces(m: usize) {
    assert!(
        m == CHAIN || m % STORE_PIECE_BLOCKS == 0,
        "a reader saw {m} blocks, part of a piece"
    );
}

#[test]
fn loom_pieced_store_is_observed_in_whole_pieces_and_removal_leaves_no_tail() {
    loom::model(|| {
        let index = Arc::new(RwLock::new(KvIndex::with_block_size(16)));
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || apply_fairly(&index, &chain_op(1, CHAIN)))
        };
        // Another worker shares the chain's first piece (nodes with two owners) and is
        // removed at an arbitrary point, as by a catalog change.
        let other = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                apply_fairly(&index, &chain_op(2, STORE_PIECE_BLOCKS));
                index.write().unwrap().remove_worker(WorkerId(2));
            })
        };
        let remover = {
            let index = Arc::clone(&index);
            thread::spawn(move || index.write().unwrap().remove_worker(WorkerId(1)))
        };
        for _ in 0..2 {
            assert_whole_pieces(matched(&index, 1));
            let m2 = matched(&index, 2);
            assert!(m2 == 0 || m2 == STORE_PIECE_BLOCKS, "worker 2 matched {m2}");
        }
        assert_eq!(writer.join().unwrap(), ApplyOutcome::Ok);
        other.join().unwrap();
        remover.join().unwrap();
        let m = matched(&index, 1);
        assert!(
            m == 0 || m == CHAIN,
            "a removal left {m} blocks of the chain"
        );
        if m == 0 {
            let stats = index.read().unwrap().primary_stats();
            assert_eq!((stats.nodes, stats.memberships), (0, 0), "{stats:?}");
        }
    });
}
