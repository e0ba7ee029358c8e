//! Integration tests of the ledger: a proptest against a plain list-of-reservations model,
//! every order of drop / free / expiry / id reuse, a bounded stress test of handles, frees
//! and expiry with total checks, and (with `--cfg loom`) a loom model of the handle.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_types::{SequenceHash, WorkerId, WorkerKey};
use load_accounting::{
    BookRequest, Ledger, LedgerConfig, LedgerError, LoadHandle, RankLoad, RankSlot, SharedLedger,
    SlotLayout, SlotPolicy,
};
use proptest::prelude::*;

#[cfg(loom)]
mod loom;

/// The obvious model: a list of reservations, every total recomputed from scratch.
#[derive(Debug, Clone)]
struct ModelReservation {
    id: String,
    worker: WorkerKey,
    path: Vec<u64>,
    prefill: u64,
    outputs: Vec<f64>,
    admitted: u64,
}

#[derive(Debug, Default)]
struct Model {
    live: Vec<ModelReservation>,
    /// Weight fraction of each active prefix `(worker, prefix)`; absent = 1.0.
    fractions: HashMap<(WorkerKey, Vec<u64>), f64>,
}

impl Model {
    fn holders(&self, worker: WorkerKey, prefix: &[u64]) -> usize {
        self.live
            .iter()
            .filter(|r| r.worker == worker && r.path.starts_with(prefix))
            .count()
    }

    fn forget_dead_prefixes(&mut self) {
        let live = std::mem::take(&mut self.fractions);
        self.fractions = live
            .into_iter()
            .filter(|((w, p), _)| self.holders(*w, p) > 0)
            .collect();
    }

    fn load(&self, worker: WorkerKey) -> RankLoad {
        let mut prefixes: Vec<&[u64]> = Vec::new();
        let mut outputs = 0.0;
        let mut prefill = 0;
        let mut requests = 0;
        for r in self.live.iter().filter(|r| r.worker == worker) {
            requests += 1;
            prefill += r.prefill;
            outputs += r.outputs.iter().sum::<f64>();
            for i in 1..=r.path.len() {
                prefixes.push(&r.path[..i]);
            }
        }
        prefixes.sort();
        prefixes.dedup();
        let prompt: f64 = prefixes
            .iter()
            .map(|p| *self.fractions.get(&(worker, p.to_vec())).unwrap_or(&1.0))
            .sum();
        RankLoad {
            active_prefill_tokens: prefill,
            active_decode_blocks: (prompt + outputs).round() as u64,
            active_requests: requests,
        }
    }

    fn position(&self, id: &str) -> Option<usize> {
        self.live.iter().position(|r| r.id == id)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Book {
        id: u8,
        rank: u8,
        path: Vec<u64>,
        prefill: Option<u64>,
        track: bool,
    },
    PrefillComplete(u8),
    Output(u8, Option<u8>),
    Free(u8),
    Advance(u64),
    Expire,
    RemoveWorker(u8),
}

const FRACTIONS: [f64; 5] = [0.0, 0.25, 0.5, 0.75, 1.0];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            0u8..12,
            0u8..4,
            prop::collection::vec(0u64..3, 0..6),
            prop::option::of(0u64..100),
            any::<bool>(),
        )
            .prop_map(|(id, rank, path, prefill, track)| Op::Book {
                id,
                rank,
                path,
                prefill,
                track,
            }),
        2 => (0u8..12).prop_map(Op::PrefillComplete),
        3 => (0u8..12, prop::option::of(0u8..6)).prop_map(|(i, f)| Op::Output(i, f)),
        2 => (0u8..12).prop_map(Op::Free),
        1 => (0u64..200).prop_map(Op::Advance),
        1 => Just(Op::Expire),
        1 => (0u8..2).prop_map(Op::RemoveWorker),
    ]
}

fn key(rank: u8) -> WorkerKey {
    // Ranks 0..4 spread over two workers so worker removal drops two ranks at once.
    WorkerKey::new(u64::from(rank / 2), u32::from(rank % 2))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn ledger_matches_the_list_model(ops in prop::collection::vec(op(), 1..80)) {
        let expiry = 300;
        let t0 = Instant::now();
        let mut clock = 0u64;
        let mut ledger = Ledger::new(LedgerConfig { expiry: Duration::from_secs(expiry) });
        let mut model = Model::default();
        // Slot hints kept from a rank's first sighting: they go stale when its worker is
        // removed and the slot is reused, as the service's roster rows do.
        let mut hints: [Option<RankSlot>; 4] = [None; 4];
        // Slots bound under one layout, kept while the ledger reports that layout (as the
        // service's roster binds them at publish): they must still name the same ranks.
        let mut bound: Option<(SlotLayout, [Option<RankSlot>; 4])> = None;
        for op in ops {
            let now = t0 + Duration::from_secs(clock);
            match op {
                Op::Book { id, rank, path, prefill, track } => {
                    let id = format!("r{id}");
                    let hashes: Vec<SequenceHash> = path.iter().copied().map(SequenceHash).collect();
                    let mut req = BookRequest::new(key(rank), &hashes, 100);
                    req.effective_prefill_tokens = prefill;
                    req.track_prefill_tokens = track;
                    let got = ledger.book(id.as_str().into(), &req, SlotPolicy::CreateMissing, now);
                    if model.position(&id).is_some() {
                        let duplicate = matches!(got, Err(LedgerError::DuplicateReservation { .. }));
                        prop_assert!(duplicate);
                    } else {
                        prop_assert!(got.is_ok());
                        let charged = match prefill { Some(p) if track && p > 0 => p, _ => 0 };
                        model.live.push(ModelReservation {
                            id, worker: key(rank), path, prefill: charged, outputs: vec![], admitted: clock,
                        });
                    }
                }
                Op::PrefillComplete(id) => {
                    let id = format!("r{id}");
                    let got = ledger.prefill_complete(&id);
                    match model.position(&id) {
                        Some(i) => { prop_assert!(got.is_ok()); model.live[i].prefill = 0; }
                        None => { let nf = matches!(got, Err(LedgerError::NotFound { .. })); prop_assert!(nf); }
                    }
                }
                Op::Output(id, f) => {
                    let id = format!("r{id}");
                    let fraction = f.map(|f| FRACTIONS.get(usize::from(f)).copied().unwrap_or(1.5));
                    let got = ledger.output_block(&id, fraction);
                    if fraction.is_some_and(|f| f > 1.0) {
                        let bad = matches!(got, Err(LedgerError::InvalidDecayFraction { .. }));
                        prop_assert!(bad);
                        continue;
                    }
                    match model.position(&id) {
                        None => { let nf = matches!(got, Err(LedgerError::NotFound { .. })); prop_assert!(nf); }
                        Some(i) => {
                            prop_assert!(got.is_ok());
                            model.live[i].outputs.push(1.0);
                            if let Some(f) = fraction {
                                for o in &mut model.live[i].outputs { *o = f; }
                                let (worker, path) = (model.live[i].worker, model.live[i].path.clone());
                                for len in (1..=path.len()).rev() {
                                    if model.holders(worker, &path[..len]) != 1 { break; }
                                    model.fractions.insert((worker, path[..len].to_vec()), f);
                                }
                            }
                        }
                    }
                }
                Op::Free(id) => {
                    let id = format!("r{id}");
                    let got = ledger.free(&id);
                    match model.position(&id) {
                        Some(i) => { prop_assert!(got.is_ok()); model.live.remove(i); model.forget_dead_prefixes(); }
                        None => { let nf = matches!(got, Err(LedgerError::NotFound { .. })); prop_assert!(nf); }
                    }
                }
                Op::Advance(s) => clock += s,
                Op::Expire => {
                    let mut got: Vec<String> = ledger.expire(now).iter().map(|i| i.to_string()).collect();
                    got.sort();
                    let mut want: Vec<String> = model.live.iter()
                        .filter(|r| clock - r.admitted > expiry)
                        .map(|r| r.id.clone()).collect();
                    want.sort();
                    prop_assert_eq!(got, want);
                    model.live.retain(|r| clock - r.admitted <= expiry);
                    model.forget_dead_prefixes();
                }
                Op::RemoveWorker(w) => {
                    let worker = WorkerId(u64::from(w));
                    let mut got: Vec<String> = ledger.remove_worker(worker).iter().map(|i| i.to_string()).collect();
                    got.sort();
                    let mut want: Vec<String> = model.live.iter()
                        .filter(|r| r.worker.worker_id == worker)
                        .map(|r| r.id.clone()).collect();
                    want.sort();
                    prop_assert_eq!(got, want);
                    model.live.retain(|r| r.worker.worker_id != worker);
                    model.forget_dead_prefixes();
                }
            }
            prop_assert_eq!(ledger.len(), model.live.len());
            let layout = ledger.slot_layout();
            let slots = match bound {
                Some((l, slots)) if l == layout => {
                    for rank in 0..4u8 {
                        prop_assert_eq!(ledger.rank_slot(key(rank)), slots[usize::from(rank)]);
                    }
                    slots
                }
                _ => {
                    let slots = [0, 1, 2, 3].map(|rank| ledger.rank_slot(key(rank)));
                    bound = Some((layout, slots));
                    slots
                }
            };
            for rank in 0..4 {
                let want = model.load(key(rank));
                let got = ledger.load(key(rank)).unwrap_or_default();
                prop_assert_eq!(got, want, "rank {}", rank);
                let probe = [SequenceHash(0), SequenceHash(1), SequenceHash(2)];
                let depth = (1..=probe.len())
                    .rev()
                    .find(|&l| {
                        let p: Vec<u64> = probe[..l].iter().map(|h| h.0).collect();
                        model.holders(key(rank), &p) > 0
                    })
                    .unwrap_or(0);
                prop_assert_eq!(ledger.overlap_depth(key(rank), &probe), depth);
                // The projection reads the load column: through the rank's own (maybe stale)
                // hint, another rank's hint and none, it must agree with the model.
                let slot = ledger.rank_slot(key(rank));
                if hints[rank as usize].is_none() { hints[rank as usize] = slot; }
                for hint in [hints[rank as usize], hints[(rank as usize + 1) % 4], None, slot] {
                    let p = ledger.potential_load_at(hint, key(rank), &probe, 7);
                    prop_assert_eq!(p.active_prefill_tokens, want.active_prefill_tokens);
                    prop_assert_eq!(p.potential_prefill_tokens, want.active_prefill_tokens + 7);
                    prop_assert_eq!(p.active_requests, want.active_requests);
                    prop_assert_eq!(p.active_decode_blocks, want.active_decode_blocks);
                    prop_assert_eq!(
                        p.potential_decode_blocks,
                        want.active_decode_blocks + (probe.len() - depth) as u64
                    );
                }
                if let Some(slot) = slots[rank as usize] {
                    let p = ledger.potential_load_bound(slot, key(rank), &probe, 7);
                    prop_assert_eq!(p, ledger.potential_load_at(None, key(rank), &probe, 7));
                }
            }
        }
    }
}

/// Every order of the four ways a booking can end or its id be reused — the handle's drop,
/// a free by id, an expiry sweep, and a new booking of the same id — against a two-line
/// model: the first booking is released exactly once and the stale handle's drop never
/// releases the newer booking.
#[test]
fn drop_free_expiry_and_reuse_release_a_booking_once_in_every_order() {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Live {
        None,
        First,
        Second,
    }
    let w = WorkerKey::new(1, 0);
    let hashes = [SequenceHash(1), SequenceHash(2)];
    let req = BookRequest::new(w, &hashes, 64).with_prefill(32);
    let mut orders = Vec::new();
    for a in 0..4 {
        for b in (0..4).filter(|&b| b != a) {
            for c in (0..4).filter(|&c| c != a && c != b) {
                orders.push([a, b, c, 6 - a - b - c]);
            }
        }
    }
    assert_eq!(orders.len(), 24);
    for order in orders {
        let ledger: SharedLedger = Arc::default();
        let t0 = Instant::now();
        let mut handle = Some(
            LoadHandle::book(&ledger, "r".into(), &req, SlotPolicy::CreateMissing, t0).unwrap(),
        );
        let mut live = Live::First;
        for step in order {
            match step {
                0 => {
                    drop(handle.take());
                    if live == Live::First {
                        live = Live::None;
                    }
                }
                1 => {
                    let freed = ledger.lock().free("r").is_ok();
                    assert_eq!(freed, live != Live::None, "{order:?}");
                    live = Live::None;
                }
                2 => {
                    let ids = ledger.lock().expire(t0 + Duration::from_secs(301));
                    assert_eq!(ids.len(), usize::from(live == Live::First), "{order:?}");
                    if live == Live::First {
                        live = Live::None;
                    }
                }
                _ => {
                    let later = t0 + Duration::from_secs(5);
                    let booked =
                        ledger
                            .lock()
                            .book("r".into(), &req, SlotPolicy::CreateMissing, later);
                    assert_eq!(booked.is_ok(), live == Live::None, "{order:?}");
                    if live == Live::None {
                        live = Live::Second;
                    }
                }
            }
            let ledger = ledger.lock();
            let load = ledger.load(w).unwrap_or_default();
            let want = if live == Live::None {
                RankLoad::default()
            } else {
                RankLoad {
                    active_prefill_tokens: 32,
                    active_decode_blocks: 2,
                    active_requests: 1,
                }
            };
            assert_eq!(load, want, "{order:?} after step {step}");
            assert_eq!(ledger.len(), usize::from(live != Live::None));
        }
    }
}

/// Bookers (through load handles: lifecycle calls, explicit release, drop, hand-off by id),
/// a freer by id and an expiry sweeper race on one ledger for a bounded number of steps.
/// Checked while running: every rank's request count and prefill tokens equal the sums over
/// its live bookings. Checked at the end: each booking was released at most once by the
/// observable paths, and once every handle is gone and a final sweep ran, nothing is left.
#[test]
fn concurrent_book_free_drop_expire_keep_totals_exact() {
    const BOOKERS: u64 = 3;
    const PER_BOOKER: u64 = 1_500;
    let ledger: SharedLedger = Arc::default();
    let t0 = Instant::now();
    let admitted = move |i: u64| t0 + Duration::from_millis(i);
    let bookers: Vec<_> = (0..BOOKERS)
        .map(|t| {
            let ledger = Arc::clone(&ledger);
            std::thread::spawn(move || {
                let hashes: Vec<SequenceHash> = (0..8).map(SequenceHash).collect();
                let mut held = Vec::new();
                let mut released = 0u64;
                for i in 0..PER_BOOKER {
                    let worker = WorkerKey::new(i % 8, 0);
                    let req =
                        BookRequest::new(worker, &hashes[..(i % 8) as usize], 128).with_prefill(64);
                    let id = format!("t{t}-{i}");
                    let h = LoadHandle::book(
                        &ledger,
                        id.into(),
                        &req,
                        SlotPolicy::CreateMissing,
                        admitted(i),
                    )
                    .unwrap();
                    // The freer or the sweeper may have taken the booking already.
                    if i % 3 == 0 {
                        let _ = h.prefill_complete();
                    }
                    if i % 5 == 0 {
                        let _ = h.output_block(Some(0.5));
                    }
                    match i % 11 {
                        0 => released += u64::from(h.release().is_ok()),
                        1 => drop(h.into_id()),
                        _ => held.push(h),
                    }
                    if held.len() > 16 {
                        // Dropping releases; the rest go at thread end.
                        held.swap_remove(0);
                    }
                }
                released
            })
        })
        .collect();
    let freer = {
        let ledger = Arc::clone(&ledger);
        std::thread::spawn(move || {
            let mut freed = 0u64;
            for k in 0..3_000u64 {
                let id = format!("t{}-{}", k % BOOKERS, (k * 7919) % PER_BOOKER);
                freed += u64::from(ledger.lock().free(&id).is_ok());
            }
            freed
        })
    };
    let sweeper = {
        let ledger = Arc::clone(&ledger);
        std::thread::spawn(move || {
            let mut expired = 0u64;
            for k in 0..300u64 {
                let now = admitted(k * 5) + load_accounting::DEFAULT_EXPIRY;
                expired += ledger.lock().expire(now).len() as u64;
                if k % 15 == 0 {
                    check_totals_against_live_bookings(&ledger.lock(), BOOKERS, PER_BOOKER);
                }
            }
            expired
        })
    };
    let released: u64 = bookers.into_iter().map(|t| t.join().unwrap()).sum();
    let freed = freer.join().unwrap();
    let expired = sweeper.join().unwrap();
    let mut ledger = ledger.lock();
    check_totals_against_live_bookings(&ledger, BOOKERS, PER_BOOKER);
    // Only bookings handed off by id can still be live; a final sweep takes them.
    let handed_off = ledger.len() as u64;
    let last = ledger.expire(admitted(PER_BOOKER) + load_accounting::DEFAULT_EXPIRY);
    assert_eq!(last.len() as u64, handed_off);
    assert!(released + freed + expired + handed_off <= BOOKERS * PER_BOOKER);
    assert!(ledger.is_empty());
    let probe: Vec<SequenceHash> = (0..8).map(SequenceHash).collect();
    for (worker, load) in ledger.loads() {
        assert_eq!(load, RankLoad::default());
        assert_eq!(ledger.overlap_depth(worker, &probe), 0);
    }
}

/// Request counts and prefill tokens per rank against the live bookings among the ids the
/// stress test uses.
fn check_totals_against_live_bookings(ledger: &Ledger, bookers: u64, per_booker: u64) {
    let mut want: HashMap<WorkerKey, (u64, u64)> = HashMap::new();
    let mut live = 0;
    for t in 0..bookers {
        for i in 0..per_booker {
            if let Some(r) = ledger.reservation(&format!("t{t}-{i}")) {
                let e = want.entry(r.worker).or_default();
                e.0 += 1;
                e.1 += r.pending_prefill_tokens;
                live += 1;
            }
        }
    }
    assert_eq!(ledger.len(), live);
    for (worker, load) in ledger.loads() {
        let (requests, prefill) = want.get(&worker).copied().unwrap_or_default();
        assert_eq!(load.active_requests, requests, "{worker}");
        assert_eq!(load.active_prefill_tokens, prefill, "{worker}");
    }
}
