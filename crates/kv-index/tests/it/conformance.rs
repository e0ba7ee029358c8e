//! `spec/indexing.md` §11, one test per case.

use std::collections::BTreeMap;

use kv_index::{ApplyOutcome, KvIndex, OverlapScores, TieredMatches};
use kv_types::{StorageTier, WorkerKey};

use crate::support::{cleared, q, removed, stored, w};

const DEV: StorageTier = StorageTier::Device;

fn matches(idx: &KvIndex, query: &[u64]) -> BTreeMap<(u64, u32), u32> {
    let mut out = OverlapScores::new();
    idx.find_matches(&q(query), &mut out);
    out.entries()
        .iter()
        .map(|e| ((e.worker.worker_id.0, e.worker.dp_rank.0), e.matched_blocks))
        .collect()
}

fn check(idx: &KvIndex, query: &[u64], expected: &[((u64, u32), u32)]) {
    assert_eq!(
        matches(idx, query),
        expected.iter().copied().collect::<BTreeMap<_, _>>(),
        "query {query:?}"
    );
}

fn state_a() -> KvIndex {
    let mut idx = KvIndex::with_block_size(16);
    for op in [
        stored(w(1, 0), DEV, None, &[(1, 101), (2, 102), (3, 103)]),
        stored(w(2, 0), DEV, None, &[(1, 101), (2, 102)]),
        stored(w(2, 0), DEV, Some(102), &[(9, 109)]),
    ] {
        assert_eq!(idx.apply(&op), ApplyOutcome::Ok);
    }
    idx
}

fn state_b() -> KvIndex {
    let mut idx = state_a();
    assert_eq!(idx.apply(&removed(w(1, 0), &[102])), ApplyOutcome::Ok);
    idx
}

fn state_c() -> KvIndex {
    let mut idx = state_b();
    assert_eq!(
        idx.apply(&stored(w(1, 0), DEV, Some(101), &[(2, 102)])),
        ApplyOutcome::Ok
    );
    idx
}

fn state_d() -> KvIndex {
    let mut idx = state_c();
    idx.apply(&stored(w(2, 1), DEV, None, &[(1, 101)]));
    idx
}

#[test]
fn case_a_prefix_scores() {
    check(&state_a(), &[1, 2, 3, 4], &[((1, 0), 3), ((2, 0), 2)]);
}

#[test]
fn case_a2_branch() {
    check(&state_a(), &[1, 2, 9], &[((1, 0), 2), ((2, 0), 3)]);
}

#[test]
fn case_a3_must_start_at_root() {
    check(&state_a(), &[2, 3], &[]);
}

#[test]
fn case_p_unknown_parent_rejected_whole() {
    let mut idx = KvIndex::with_block_size(16);
    assert_eq!(
        idx.apply(&stored(w(3, 0), DEV, Some(555), &[(1, 101)])),
        ApplyOutcome::ParentBlockNotFound
    );
    assert_eq!(idx.counters().stored_parent_block_not_found, 1);
    assert_eq!(idx.primary_stats().nodes, 0);
    check(&idx, &[1], &[]);
}

#[test]
fn case_b_remove_middle_block() {
    check(&state_b(), &[1, 2, 3, 4], &[((1, 0), 1), ((2, 0), 2)]);
}

#[test]
fn case_u_unknown_remove_is_counted_and_changes_nothing() {
    let mut idx = state_a();
    assert_eq!(
        idx.apply(&removed(w(1, 0), &[999])),
        ApplyOutcome::BlockNotFound { missing: 1 }
    );
    let c = idx.counters();
    assert_eq!((c.removed_block_not_found, c.blocks_not_found), (1, 1));
    check(&idx, &[1, 2, 3, 4], &[((1, 0), 3), ((2, 0), 2)]);
}

#[test]
fn case_c_restore_middle_reconnects_child() {
    check(&state_c(), &[1, 2, 3, 4], &[((1, 0), 3), ((2, 0), 2)]);
}

#[test]
fn case_d_second_rank() {
    check(
        &state_d(),
        &[1, 2, 3],
        &[((1, 0), 3), ((2, 0), 2), ((2, 1), 1)],
    );
}

#[test]
fn case_e_cleared_touches_one_rank() {
    let mut idx = state_d();
    assert_eq!(idx.apply(&cleared(w(2, 0))), ApplyOutcome::Ok);
    check(&idx, &[1, 2, 3], &[((1, 0), 3), ((2, 1), 1)]);
}

#[test]
fn case_f_matching_uses_local_hashes() {
    let mut idx = KvIndex::with_block_size(16);
    idx.apply(&stored(w(1, 0), DEV, None, &[(1, 101), (2, 102)]));
    idx.apply(&stored(w(2, 0), DEV, None, &[(1, 201), (2, 202)]));
    check(&idx, &[1, 2], &[((1, 0), 2), ((2, 0), 2)]);
}

fn state_g() -> KvIndex {
    let mut idx = KvIndex::with_block_size(16);
    idx.apply(&stored(w(1, 0), DEV, None, &[(1, 101), (2, 102), (3, 103)]));
    idx.apply(&removed(w(1, 0), &[101]));
    idx
}

#[test]
fn case_g_removed_head_hides_the_chain() {
    check(&state_g(), &[1, 2, 3], &[]);
}

#[test]
fn case_h_per_block_model_keeps_the_tail() {
    // The per-block model answers 3 (the reference's compressed tree answers 1, §2.5).
    let mut idx = state_g();
    idx.apply(&stored(w(1, 0), DEV, None, &[(1, 101)]));
    check(&idx, &[1, 2, 3], &[((1, 0), 3)]);
}

#[test]
fn case_t_host_tier_continues_the_device_prefix() {
    let mut idx = KvIndex::with_block_size(16);
    idx.apply(&stored(w(7, 0), DEV, None, &[(11, 511), (12, 512)]));
    idx.apply(&stored(
        w(7, 0),
        StorageTier::HostPinned,
        Some(512),
        &[(13, 513)],
    ));
    check(&idx, &[11, 12, 13], &[((7, 0), 2)]);
    let mut t = TieredMatches::new();
    idx.find_tiered(&q(&[11, 12, 13]), &mut t);
    let h = *t.get(w(7, 0)).unwrap();
    assert_eq!((h.device, h.host_pinned, h.disk, h.external), (2, 1, 0, 0));
    assert_eq!((h.gpu(), h.cpu(), h.disk_cumulative()), (2, 3, 3));
}

#[test]
fn lower_tiers_continue_from_each_workers_own_device_hash() {
    // Two engines hashing the same tokens differently share the device nodes; each one's
    // host and disk blocks chain under its own hashes (indexing §4.4 step 1 anchors on the
    // worker's last matched hash), so both are credited (beyond-reference #8).
    let mut idx = KvIndex::with_block_size(16);
    let (a, b) = (w(1, 0), w(2, 0));
    idx.apply(&stored(a, DEV, None, &[(1, 11), (2, 12)]));
    idx.apply(&stored(b, DEV, None, &[(1, 21)]));
    idx.apply(&stored(b, StorageTier::HostPinned, Some(21), &[(2, 22)]));
    idx.apply(&stored(b, StorageTier::Disk, Some(22), &[(3, 23)]));
    idx.apply(&stored(a, StorageTier::HostPinned, Some(12), &[(3, 13)]));
    let mut t = TieredMatches::new();
    idx.find_tiered(&q(&[1, 2, 3, 4]), &mut t);
    let tiers = |h: &kv_index::TierHits| (h.device, h.host_pinned, h.disk);
    assert_eq!(tiers(t.get(a).unwrap()), (2, 1, 0));
    assert_eq!(tiers(t.get(b).unwrap()), (1, 1, 1));
}

#[test]
fn duplicate_store_is_a_warning_and_empty_store_a_no_op() {
    let mut idx = state_a();
    assert_eq!(
        idx.apply(&stored(w(1, 0), DEV, None, &[(1, 101), (2, 102)])),
        ApplyOutcome::DuplicateStore
    );
    assert_eq!(
        idx.apply(&stored(w(1, 0), DEV, Some(4242), &[])),
        ApplyOutcome::Ok
    );
    let c = idx.counters();
    assert_eq!((c.stored_ok, c.duplicate_store), (5, 1));
}

#[test]
fn tiered_walks_in_order_and_lower_roots_seed_new_workers() {
    let mut idx = KvIndex::with_block_size(16);
    let (a, b) = (w(1, 0), w(2, 0));
    idx.apply(&stored(a, DEV, None, &[(1, 11)]));
    idx.apply(&stored(a, StorageTier::Disk, Some(11), &[(2, 12), (3, 13)]));
    // Host tier has a's block 2 too; host runs before disk and takes it.
    idx.apply(&stored(a, StorageTier::HostPinned, Some(11), &[(2, 12)]));
    // b only on the external tier, from the root.
    idx.apply(&stored(b, StorageTier::External, None, &[(1, 11), (2, 12)]));
    let mut t = TieredMatches::new();
    idx.find_tiered(&q(&[1, 2, 3, 4]), &mut t);
    let ha = *t.get(a).unwrap();
    assert_eq!(
        (ha.device, ha.host_pinned, ha.disk, ha.external),
        (1, 1, 1, 0)
    );
    let hb = *t.get(b).unwrap();
    assert_eq!(
        (hb.device, hb.host_pinned, hb.disk, hb.external),
        (0, 0, 0, 2)
    );
    let s = t.instance_overlap(kv_types::WorkerId(1), 0..1, 16);
    assert_eq!((s.gpu, s.cpu, s.disk, s.longest_matched), (16, 32, 48, 48));

    // Cleared on any tier resets the worker key everywhere.
    idx.apply(&cleared(a));
    idx.find_tiered(&q(&[1, 2, 3, 4]), &mut t);
    assert!(t.get(a).is_none());
    assert!(t.get(b).is_some());
    idx.remove_worker(kv_types::WorkerId(2));
    idx.find_tiered(&q(&[1, 2, 3, 4]), &mut t);
    assert!(t.hits().is_empty());
}

mod approximate {
    use std::time::{Duration, Instant};

    use kv_index::{IndexConfig, IndexConfigError, IndexConfigWarning, RecordOutcome};

    use super::*;

    fn approx(ttl: Duration, t0: Instant) -> KvIndex {
        let config = IndexConfig {
            use_kv_events: false,
            router_ttl: ttl,
            ..IndexConfig::default()
        };
        KvIndex::new(&config, t0)
    }

    #[test]
    fn recorded_decisions_route_until_the_ttl_expires() {
        let t0 = Instant::now();
        let mut idx = approx(Duration::from_secs(120), t0);
        let worker = w(3, 0);
        assert_eq!(
            idx.record_decision(worker, &q(&[1, 2, 3]), t0),
            RecordOutcome::Recorded
        );
        assert_eq!(
            idx.record_decision(worker, &[], t0),
            RecordOutcome::NotRecorded
        );
        check(&idx, &[1, 2, 3, 4], &[((3, 0), 3)]);
        // A newer decision for the prefix [1] re-arms only that block.
        idx.record_decision(worker, &q(&[1]), t0 + Duration::from_secs(60));
        assert_eq!(idx.expire(t0 + Duration::from_secs(119), 1000), 0);
        assert_eq!(idx.expire(t0 + Duration::from_secs(120), 1000), 2);
        check(&idx, &[1, 2, 3], &[((3, 0), 1)]);
        assert_eq!(idx.expire(t0 + Duration::from_secs(180), 1000), 1);
        check(&idx, &[1, 2, 3], &[]);
        assert_eq!(idx.counters().approx_expired, 3);
    }

    #[test]
    fn a_decision_with_its_chain_records_what_the_plain_one_does() {
        let t0 = Instant::now();
        let mut plain = approx(Duration::from_secs(10), t0);
        let mut chained = approx(Duration::from_secs(10), t0);
        let worker = w(4, 1);
        let locals = q(&[5, 6, 7, 8]);
        let mut seqs = Vec::new();
        kv_types::sequence_hashes_into(&locals, &mut seqs);
        assert_eq!(
            chained.record_decision_chained(worker, &locals, &seqs, t0),
            plain.record_decision(worker, &locals, t0)
        );
        assert_eq!(chained.snapshot_operations(), plain.snapshot_operations());
        check(&chained, &[5, 6, 7, 8], &[((4, 1), 4)]);
        // The timers are keyed by the same chain: all four expire together.
        assert_eq!(chained.expire(t0 + Duration::from_secs(10), 1000), 4);
        check(&chained, &[5, 6, 7, 8], &[]);
        assert_eq!(
            chained.record_decision_chained(worker, &[], &[], t0),
            RecordOutcome::NotRecorded
        );
    }

    #[test]
    fn removing_a_rank_drops_its_blocks_and_timers() {
        let t0 = Instant::now();
        let mut idx = approx(Duration::from_secs(10), t0);
        let worker = w(1, 0);
        idx.record_decision(worker, &q(&[1, 2, 3]), t0);
        idx.record_decision(worker, &q(&[1, 2, 3]), t0 + Duration::from_secs(5));
        check(&idx, &[1, 2, 3], &[((1, 0), 3)]);
        idx.remove_rank(worker);
        check(&idx, &[1, 2, 3], &[]);
        assert_eq!(idx.expire(t0 + Duration::from_secs(100), 1000), 0);
    }

    #[test]
    fn side_index_credit_merges_by_max_and_never_seeds_lower_tiers() {
        let t0 = Instant::now();
        let config = IndexConfig {
            predicted_ttl: Some(Duration::from_secs(2)),
            ..IndexConfig::default()
        };
        let mut idx = KvIndex::new(&config, t0);
        let (a, b) = (w(1, 0), w(2, 0));
        idx.apply(&stored(a, DEV, None, &[(1, 11)]));
        idx.apply(&stored(a, StorageTier::HostPinned, Some(11), &[(2, 12)]));
        idx.record_decision(a, &q(&[1, 2, 3]), t0);
        idx.record_decision(b, &q(&[1]), t0);
        check(&idx, &[1, 2, 3], &[((1, 0), 3), ((2, 0), 1)]);
        let mut t = TieredMatches::new();
        idx.find_tiered(&q(&[1, 2, 3]), &mut t);
        let ha = *t.get(a).unwrap();
        // Host continuation was seeded from the exact device score 1, then side credit 3.
        assert_eq!((ha.device, ha.host_pinned), (3, 1));
        assert_eq!(t.get(b).unwrap().device, 1);
        // The side index is never dumped.
        assert_eq!(idx.snapshot_operations().len(), 2);
        idx.expire(t0 + Duration::from_secs(3), 1000);
        check(&idx, &[1, 2, 3], &[((1, 0), 1)]);
    }

    #[test]
    fn config_combinations_of_the_spec() {
        let ok = IndexConfig::default();
        assert_eq!(ok.validate(), Ok(vec![]));
        let lru_events = IndexConfig {
            approximate_cache_policy: kv_index::ApproxCachePolicy::Lru,
            ..IndexConfig::default()
        };
        assert_eq!(
            lru_events.validate(),
            Err(IndexConfigError::LruWithKvEvents)
        );
        let lru_approx = IndexConfig {
            use_kv_events: false,
            ..lru_events
        };
        assert_eq!(
            lru_approx.validate(),
            Ok(vec![IndexConfigWarning::LruFallsBackToTtl])
        );
        let side_approx = IndexConfig {
            use_kv_events: false,
            predicted_ttl: Some(Duration::from_secs(1)),
            ..IndexConfig::default()
        };
        let err = side_approx.validate().unwrap_err();
        assert_eq!(err, IndexConfigError::PredictedTtlWithoutKvEvents);
        assert!(
            err.to_string()
                .starts_with("router_predicted_ttl_secs requires use_kv_events=true")
        );
    }
}

#[test]
fn dump_of_the_spec_example_replays_to_the_same_answers() {
    let mut idx = KvIndex::with_block_size(16);
    idx.apply(&stored(w(1, 0), DEV, None, &[(1, 101), (2, 102), (3, 103)]));
    idx.apply(&stored(w(2, 1), DEV, None, &[(1, 101)]));
    let ops = idx.snapshot_operations();
    // Runs of identical owner sets: [1] for both workers, then [2,3] for worker 1.
    assert_eq!(ops.len(), 3);
    assert_eq!(ops[2].worker, WorkerKey::new(1, 0));
    let mut copy = KvIndex::with_block_size(16);
    for op in &ops {
        assert_eq!(copy.apply(op), ApplyOutcome::Ok);
    }
    for query in [&[1u64, 2, 3][..], &[1], &[1, 2], &[2]] {
        assert_eq!(matches(&copy, query), matches(&idx, query));
    }
}

/// A store applied in pieces (each piece's parent = the previous piece's last block) equals
/// the whole store, in answers and in counters.
#[test]
fn a_store_applied_in_pieces_equals_the_whole_store() {
    let w = WorkerKey::new(1, 0);
    let pairs: Vec<(u64, u64)> = (1..=1000).map(|i| (i, 10_000 + i)).collect();
    let whole_op = stored(w, StorageTier::Device, None, &pairs);
    let mut whole = KvIndex::with_block_size(16);
    whole.apply(&whole_op);

    let mut pieces = KvIndex::with_block_size(16);
    let kv_types::KvOperationKind::Stored { blocks, .. } = &whole_op.kind else {
        unreachable!()
    };
    let mut parent = None;
    for (i, piece) in blocks.chunks(128).enumerate() {
        assert_eq!(
            pieces.apply_stored_piece(w, parent, piece, i == 0),
            ApplyOutcome::Ok
        );
        parent = piece.last().map(|b| b.block_hash);
    }
    let query: Vec<u64> = (1..=1000).collect();
    assert_eq!(matches(&pieces, &query), matches(&whole, &query));
    assert_eq!(matches(&pieces, &query).get(&(1, 0)), Some(&1000));
    assert_eq!(pieces.counters(), whole.counters());

    // An unknown parent rejects the first piece and is counted once.
    let mut orphan = KvIndex::with_block_size(16);
    let out = orphan.apply_stored_piece(w, Some(kv_types::ExternalHash(7)), &blocks[..10], true);
    assert_eq!(out, ApplyOutcome::ParentBlockNotFound);
    assert_eq!(orphan.counters().stored_parent_block_not_found, 1);
}
