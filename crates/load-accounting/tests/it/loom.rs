//! loom model of the load handle's release-once protocol (compiled only with `--cfg loom`;
//! run by `cargo xtask loom`). Under loom the ledger lock is loom's mutex (`src/sync.rs`),
//! so this drives the real [`LoadHandle`] and [`load_accounting::Ledger`] through every
//! interleaving of a handle drop, a free by id followed by a rebooking of the same id, and
//! an expiry sweep.
//!
//! Invariant: the first booking is released exactly once (by whichever of the three comes
//! first), the drop of its stale handle never touches the rebooked id, and the totals equal
//! the live bookings afterwards.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_types::{SequenceHash, WorkerKey};
use load_accounting::{
    BookRequest, DEFAULT_EXPIRY, LoadHandle, RankLoad, ReservationId, SharedLedger, SlotPolicy,
};

const W: WorkerKey = WorkerKey::new(1, 0);
const PREFILL: u64 = 32;

fn request(hashes: &[SequenceHash]) -> BookRequest<'_> {
    BookRequest::new(W, hashes, 64).with_prefill(PREFILL)
}

#[test]
fn loom_a_booking_is_released_exactly_once() {
    loom::model(|| {
        let t0 = Instant::now();
        let hashes = [SequenceHash(1), SequenceHash(2)];
        let ledger: SharedLedger = Arc::default();
        let handle = LoadHandle::book(
            &ledger,
            ReservationId::from("r"),
            &request(&hashes),
            SlotPolicy::CreateMissing,
            t0,
        )
        .unwrap();
        let first = handle.seq();

        let owner = loom::thread::spawn(move || {
            // A lifecycle call through the handle may find the booking gone; then drop.
            let _ = handle.prefill_complete();
            drop(handle);
        });
        let api = {
            let ledger = Arc::clone(&ledger);
            loom::thread::spawn(move || {
                let freed = ledger.lock().free("r");
                let Ok(freed) = freed else {
                    return (false, None);
                };
                assert_eq!(freed.seq, first);
                // The id is free again: a new request reuses it, admitted later than t0.
                let h = [SequenceHash(1), SequenceHash(2)];
                let again = ledger.lock().book(
                    "r".into(),
                    &request(&h),
                    SlotPolicy::CreateMissing,
                    t0 + Duration::from_secs(5),
                );
                (true, again.ok())
            })
        };
        let sweeper = {
            let ledger = Arc::clone(&ledger);
            // Old enough to expire the first booking, not the rebooked one.
            loom::thread::spawn(move || {
                let ids = ledger
                    .lock()
                    .expire(t0 + DEFAULT_EXPIRY + Duration::from_secs(1));
                ids.iter().any(|i| i.as_str() == "r")
            })
        };
        owner.join().unwrap();
        let (api_freed, rebooked) = api.join().unwrap();
        let expired = sweeper.join().unwrap();

        assert!(
            !(api_freed && expired),
            "the first booking was released twice"
        );
        let ledger = ledger.lock();
        let load = ledger.load(W).unwrap_or_default();
        match rebooked {
            Some(seq) => {
                assert_ne!(seq, first);
                assert_eq!(ledger.reservation("r").map(|r| r.seq), Some(seq));
                assert_eq!(
                    load,
                    RankLoad {
                        active_prefill_tokens: PREFILL,
                        active_decode_blocks: 2,
                        active_requests: 1,
                    }
                );
            }
            None => {
                assert!(ledger.is_empty());
                assert_eq!(load, RankLoad::default());
            }
        }
    });
}
