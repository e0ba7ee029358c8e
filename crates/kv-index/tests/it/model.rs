//! Property tests: the index against a naive model of prefix chains (event-fed, and
//! approximate mode with recorded decisions and TTL expiry), and snapshot round trips.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kv_index::snapshot::{DecodeLimits, Dump, PartitionDump, decode_dump, encode_dump};
use kv_index::{KvIndex, OverlapScores, SharedKvIndex, SlotDepths, TieredMatches};
use kv_types::{StorageTier, WorkerId, WorkerKey};
use proptest::prelude::*;

use crate::support::{cleared, q, removed, stored, w};

/// Per worker key: external hash → path of local hashes, and the owned paths.
#[derive(Clone, Default, Debug)]
struct ModelWorker {
    map: HashMap<u64, Vec<u64>>,
    owned: BTreeSet<Vec<u64>>,
}

#[derive(Clone, Default, Debug)]
struct Model {
    workers: BTreeMap<WorkerKey, ModelWorker>,
}

impl Model {
    fn parent_path(&self, worker: WorkerKey, parent: Option<u64>) -> Option<Vec<u64>> {
        match parent {
            None => Some(Vec::new()),
            Some(p) => {
                let mw = self.workers.get(&worker)?;
                let path = mw.map.get(&p)?;
                mw.owned.contains(path).then(|| path.clone())
            }
        }
    }

    fn stored(&mut self, worker: WorkerKey, parent: Option<u64>, blocks: &[(u64, u64)]) -> bool {
        if blocks.is_empty() {
            return true;
        }
        let Some(mut path) = self.parent_path(worker, parent) else {
            return false;
        };
        let mw = self.workers.entry(worker).or_default();
        for &(l, e) in blocks {
            path.push(l);
            mw.owned.insert(path.clone());
            mw.map.insert(e, path.clone());
        }
        true
    }

    fn removed(&mut self, worker: WorkerKey, hashes: &[u64]) {
        if let Some(mw) = self.workers.get_mut(&worker) {
            for h in hashes {
                if let Some(p) = mw.map.remove(h) {
                    mw.owned.remove(&p);
                }
            }
        }
    }

    /// What a dump keeps (indexing §9.1): only blocks a worker reaches from the root.
    fn reachable(&self) -> Model {
        let mut out = self.clone();
        for mw in out.workers.values_mut() {
            let owned = mw.owned.clone();
            mw.owned
                .retain(|p| (1..p.len()).all(|end| owned.contains(&p[..end])));
            let ModelWorker { map, owned } = mw;
            map.retain(|_, p| owned.contains(p));
        }
        out.workers.retain(|_, mw| !mw.owned.is_empty());
        out
    }

    fn scores(&self, query: &[u64]) -> BTreeMap<WorkerKey, u32> {
        let mut out = BTreeMap::new();
        for (&k, mw) in &self.workers {
            let mut d = 0;
            while d < query.len() && mw.owned.contains(&query[..=d]) {
                d += 1;
            }
            if d > 0 {
                out.insert(k, d as u32);
            }
        }
        out
    }
}

fn index_scores(idx: &KvIndex, query: &[u64], out: &mut OverlapScores) -> BTreeMap<WorkerKey, u32> {
    idx.find_matches(&q(query), out);
    let map: BTreeMap<_, _> = out
        .entries()
        .iter()
        .map(|e| (e.worker, e.matched_blocks))
        .collect();
    assert_eq!(map.len(), out.len(), "one entry per worker");
    // The per-slot form of the same query says the same, through a buffer reused across
    // queries and indexes (its cached slot keys must follow slot changes).
    DEPTHS.with_borrow_mut(|depths| {
        if idx.find_device_depths(&q(query), depths) {
            let dense: BTreeMap<_, _> = depths
                .keys()
                .iter()
                .enumerate()
                .filter_map(|(slot, key)| {
                    let d = depths.depth(slot as u32);
                    key.filter(|_| d > 0).map(|k| (k, d))
                })
                .collect();
            assert_eq!(dense, map, "find_device_depths disagrees with find_matches");
        }
    });
    map
}

thread_local! {
    static DEPTHS: std::cell::RefCell<SlotDepths> = std::cell::RefCell::new(SlotDepths::new());
}

#[derive(Clone, Debug)]
enum Op {
    /// worker, parent selector (None = root; Some(i) = i-th known hash or unknown), blocks.
    Stored(u8, Option<u8>, Vec<(u8, u8)>),
    Removed(u8, Vec<u8>),
    Cleared(u8),
    RemoveWorkerId(u8),
    RemoveRank(u8),
}

fn worker_of(i: u8) -> WorkerKey {
    w(u64::from(i % 3), u32::from(i / 3 % 2))
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), prop::option::of(any::<u8>()), prop::collection::vec((0u8..3, any::<u8>()), 0..5))
            .prop_map(|(w, p, b)| Op::Stored(w, p, b)),
        3 => (any::<u8>(), prop::collection::vec(any::<u8>(), 0..4)).prop_map(|(w, h)| Op::Removed(w, h)),
        1 => any::<u8>().prop_map(Op::Cleared),
        1 => any::<u8>().prop_map(Op::RemoveWorkerId),
        1 => any::<u8>().prop_map(Op::RemoveRank),
    ]
}

/// Picks one of the worker's known hashes (sorted) or, for high selectors, an unknown one.
fn pick_hash(model: &Model, worker: WorkerKey, sel: u8, universe: u64) -> u64 {
    let known: Vec<u64> = model
        .workers
        .get(&worker)
        .map(|mw| {
            let mut v: Vec<u64> = mw.map.keys().copied().collect();
            v.sort_unstable();
            v
        })
        .unwrap_or_default();
    if sel < 200 && !known.is_empty() {
        known[usize::from(sel) % known.len()]
    } else {
        1_000 + u64::from(sel) % universe
    }
}

/// External hash of a path when the engine invariant holds (one chain ↔ one hash chain).
fn chain_hash(path: &[u64]) -> u64 {
    path.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &l| {
        (h ^ (l + 1)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// How the engines of a test name blocks.
#[derive(Clone, Copy, Debug)]
enum Hashes {
    /// One hash chain for one token chain on every worker (the engine hash invariant).
    Shared,
    /// Each worker's own chain for the same tokens (vLLM without a fixed hash seed).
    PerWorker,
    /// A tiny range, so engines "reuse" hashes at other positions (aliasing): a stress case.
    Aliasing,
}

impl Hashes {
    fn any() -> impl Strategy<Value = Hashes> {
        prop_oneof![
            Just(Hashes::Shared),
            Just(Hashes::PerWorker),
            Just(Hashes::Aliasing)
        ]
    }

    /// The hash `worker` stores `path` under, when that is a function of the path.
    fn of(self, worker: WorkerKey, path: &[u64]) -> Option<u64> {
        match self {
            Hashes::Shared => Some(chain_hash(path)),
            Hashes::PerWorker => {
                let seed = (worker.worker_id.0 * 2 + u64::from(worker.dp_rank.0) + 1) << 56;
                Some(chain_hash(path) ^ seed)
            }
            Hashes::Aliasing => None,
        }
    }
}

/// Checks every match's `last_external` against the hash its worker stored that block
/// under, where hashes are a function of the path.
fn check_last_external(out: &OverlapScores, query: &[u64], hashes: Hashes) {
    for e in out.entries() {
        let path = &query[..e.matched_blocks as usize];
        if let Some(expected) = hashes.of(e.worker, path) {
            assert_eq!(e.last_external.0, expected, "{:?} on {query:?}", e.worker);
        }
    }
}

/// Applies `op` to both, naming blocks as `hashes` says.
fn apply(model: &mut Model, idx: &mut KvIndex, op: &Op, hashes: Hashes) {
    match op {
        Op::Stored(wi, parent_sel, blocks) => {
            let worker = worker_of(*wi);
            let parent = parent_sel.map(|s| pick_hash(model, worker, s, 6));
            let mut path = model.parent_path(worker, parent).unwrap_or_default();
            let pairs: Vec<(u64, u64)> = blocks
                .iter()
                .map(|&(l, e)| {
                    let l = u64::from(l);
                    path.push(l);
                    let e = hashes.of(worker, &path).unwrap_or(u64::from(e % 8));
                    (l, e)
                })
                .collect();
            let accepted = model.stored(worker, parent, &pairs);
            let outcome = idx.apply(&stored(worker, StorageTier::Device, parent, &pairs));
            assert_eq!(
                accepted,
                outcome != kv_index::ApplyOutcome::ParentBlockNotFound,
                "{op:?}"
            );
        }
        Op::Removed(wi, sels) => {
            let worker = worker_of(*wi);
            let hashes: Vec<u64> = sels
                .iter()
                .map(|&s| pick_hash(model, worker, s, 6))
                .collect();
            let known = model.workers.get(&worker).map_or(0, |mw| {
                let distinct: BTreeSet<u64> = hashes.iter().copied().collect();
                distinct.iter().filter(|h| mw.map.contains_key(h)).count()
            });
            model.removed(worker, &hashes);
            // Every hash the model knows is found once; the rest (and repeats) are not.
            let expected = if known == hashes.len() {
                kv_index::ApplyOutcome::Ok
            } else {
                kv_index::ApplyOutcome::BlockNotFound {
                    missing: (hashes.len() - known) as u32,
                }
            };
            assert_eq!(idx.apply(&removed(worker, &hashes)), expected, "{op:?}");
        }
        Op::Cleared(wi) => {
            let worker = worker_of(*wi);
            model.workers.remove(&worker);
            idx.apply(&cleared(worker));
        }
        Op::RemoveWorkerId(wi) => {
            let id = worker_of(*wi).worker_id;
            model.workers.retain(|k, _| k.worker_id != id);
            idx.remove_worker(id);
        }
        Op::RemoveRank(wi) => {
            let worker = worker_of(*wi);
            model.workers.remove(&worker);
            idx.remove_rank(worker);
        }
    }
}

fn queries_of(model: &Model, random: &[Vec<u8>]) -> Vec<Vec<u64>> {
    let mut out: Vec<Vec<u64>> = random
        .iter()
        .map(|v| v.iter().map(|&x| u64::from(x)).collect())
        .collect();
    for mw in model.workers.values() {
        for p in &mw.owned {
            let mut long = p.clone();
            long.push(0);
            out.push(p.clone());
            out.push(long);
        }
    }
    out
}

/// Approximate mode (`indexing.md` §5): a recorded decision owns every prefix of its chain
/// until `ttl` after the latest record of that prefix; expiry drops exactly those whose
/// deadline has passed; removing a worker or rank drops its entries.
#[derive(Default, Debug)]
struct ApproxModel {
    /// (worker, path) → deadline, whole seconds since the index's origin.
    entries: BTreeMap<(WorkerKey, Vec<u64>), u64>,
}

impl ApproxModel {
    fn record(&mut self, worker: WorkerKey, locals: &[u64], now: u64, ttl: u64) {
        for end in 1..=locals.len() {
            self.entries
                .insert((worker, locals[..end].to_vec()), now + ttl);
        }
    }

    fn scores(&self, query: &[u64]) -> BTreeMap<WorkerKey, u32> {
        let workers: BTreeSet<WorkerKey> = self.entries.keys().map(|(w, _)| *w).collect();
        let mut out = BTreeMap::new();
        for worker in workers {
            let mut d = 0;
            while d < query.len() && self.entries.contains_key(&(worker, query[..=d].to_vec())) {
                d += 1;
            }
            if d > 0 {
                out.insert(worker, d as u32);
            }
        }
        out
    }
}

#[derive(Clone, Debug)]
enum ApproxOp {
    Record(u8, Vec<u8>),
    /// Whole seconds forward.
    Advance(u8),
    Expire,
    RemoveWorkerId(u8),
    RemoveRank(u8),
}

fn approx_op_strategy() -> impl Strategy<Value = ApproxOp> {
    prop_oneof![
        6 => (any::<u8>(), prop::collection::vec(0u8..3, 1..6)).prop_map(|(w, l)| ApproxOp::Record(w, l)),
        3 => (0u8..8).prop_map(ApproxOp::Advance),
        3 => Just(ApproxOp::Expire),
        1 => any::<u8>().prop_map(ApproxOp::RemoveWorkerId),
        1 => any::<u8>().prop_map(ApproxOp::RemoveRank),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn approximate_index_matches_model(
        ops in prop::collection::vec(approx_op_strategy(), 1..60),
        queries in prop::collection::vec(prop::collection::vec(0u8..3, 0..6), 1..8),
    ) {
        const TTL: u64 = 10;
        let origin = std::time::Instant::now();
        let config = kv_index::IndexConfig {
            block_size: 4,
            use_kv_events: false,
            router_ttl: std::time::Duration::from_secs(TTL),
            ..kv_index::IndexConfig::default()
        };
        let mut idx = KvIndex::new(&config, origin);
        let mut model = ApproxModel::default();
        let mut out = OverlapScores::new();
        // Whole seconds: deadlines land exactly on the index's 100 ms grid, so "expired"
        // means the same on both sides.
        let mut now = 0u64;
        let at = |secs: u64| origin + std::time::Duration::from_secs(secs);
        for op in &ops {
            match op {
                ApproxOp::Record(wi, locals) => {
                    let worker = worker_of(*wi);
                    let locals: Vec<u64> = locals.iter().map(|&l| u64::from(l)).collect();
                    idx.record_decision(worker, &q(&locals), at(now));
                    model.record(worker, &locals, now, TTL);
                }
                ApproxOp::Advance(secs) => now += u64::from(*secs),
                ApproxOp::Expire => {
                    // A small budget: draining in several calls must add up to one.
                    while idx.expire(at(now), 3) == 3 {}
                    model.entries.retain(|_, deadline| *deadline > now);
                }
                ApproxOp::RemoveWorkerId(wi) => {
                    let id = worker_of(*wi).worker_id;
                    idx.remove_worker(id);
                    model.entries.retain(|(w, _), _| w.worker_id != id);
                }
                ApproxOp::RemoveRank(wi) => {
                    let worker = worker_of(*wi);
                    idx.remove_rank(worker);
                    model.entries.retain(|(w, _), _| *w != worker);
                }
            }
            let mut all: Vec<Vec<u64>> = queries
                .iter()
                .map(|v| v.iter().map(|&x| u64::from(x)).collect())
                .collect();
            all.extend(model.entries.keys().map(|(_, p)| p.clone()));
            for query in all {
                prop_assert_eq!(index_scores(&idx, &query, &mut out), model.scores(&query), "query {:?} after {:?}", query, op);
            }
        }
    }

    #[test]
    fn index_matches_model(
        ops in prop::collection::vec(op_strategy(), 1..60),
        queries in prop::collection::vec(prop::collection::vec(0u8..3, 0..6), 1..8),
        hashes in Hashes::any(),
    ) {
        let mut model = Model::default();
        let mut idx = KvIndex::with_block_size(4);
        let mut out = OverlapScores::new();
        for (i, op) in ops.iter().enumerate() {
            apply(&mut model, &mut idx, op, hashes);
            if i % 4 == 3 || i + 1 == ops.len() {
                for query in queries_of(&model, &queries) {
                    prop_assert_eq!(index_scores(&idx, &query, &mut out), model.scores(&query), "query {:?}", query);
                    check_last_external(&out, &query, hashes);
                }
            }
        }
        // Everything removed: the trie is empty again (no leaked nodes or slots).
        for id in 0..3 {
            idx.remove_worker(WorkerId(id));
        }
        prop_assert_eq!(idx.primary_stats(), kv_index::PrefixIndexStats::default());
    }

    #[test]
    fn snapshot_round_trip_answers_like_the_original(
        ops in prop::collection::vec(op_strategy(), 1..60),
        lower in prop::collection::vec((0u8..3, any::<u8>(), prop::option::of(0u8..4), prop::collection::vec(0u8..3, 1..4)), 0..12),
        queries in prop::collection::vec(prop::collection::vec(0u8..3, 0..6), 1..8),
        per_worker in any::<bool>(),
        later in prop::collection::vec(op_strategy(), 0..12),
    ) {
        let hashes = if per_worker { Hashes::PerWorker } else { Hashes::Shared };
        let mut model = Model::default();
        let mut idx = KvIndex::with_block_size(16);
        for op in &ops {
            apply(&mut model, &mut idx, op, hashes);
        }
        for (tier, wi, parent, locals) in &lower {
            let tier = StorageTier::LOWER[usize::from(*tier)];
            let worker = worker_of(*wi);
            let hash = |path: &[u64]| hashes.of(worker, path).unwrap_or_default();
            let mut path: Vec<u64> = parent.map(|p| vec![u64::from(p)]).unwrap_or_default();
            let parent = parent.map(|_| hash(&path));
            let pairs: Vec<(u64, u64)> = locals.iter().map(|&l| {
                path.push(u64::from(l));
                (u64::from(l), hash(&path))
            }).collect();
            idx.apply(&stored(worker, tier, parent, &pairs));
        }
        let mut dump = Dump::new();
        dump.insert("m:default".to_owned(), PartitionDump::Snapshot { block_size: 16, events: idx.snapshot_operations() });
        let bytes = encode_dump(&dump).unwrap();
        let decoded = decode_dump(&bytes, &DecodeLimits::default()).unwrap();
        prop_assert_eq!(&decoded, &dump);
        let Some(PartitionDump::Snapshot { block_size, events }) = decoded.get("m:default") else {
            panic!("partition missing");
        };
        let copy = SharedKvIndex::new(KvIndex::with_block_size(*block_size));
        let report = copy.restore(events);
        prop_assert_eq!(report.parent_block_not_found, 0);
        let mut copy = copy.into_inner();
        let (mut a, mut b) = (TieredMatches::new(), TieredMatches::new());
        for query in queries_of(&model, &queries) {
            idx.find_tiered(&q(&query), &mut a);
            copy.find_tiered(&q(&query), &mut b);
            let mut ha = a.hits().to_vec();
            let mut hb = b.hits().to_vec();
            ha.sort_by_key(|h| h.worker);
            hb.sort_by_key(|h| h.worker);
            prop_assert_eq!(ha, hb, "query {:?}", query);
            let mut ea = a.device().entries().to_vec();
            let mut eb = b.device().entries().to_vec();
            ea.sort_by_key(|e| e.worker);
            eb.sort_by_key(|e| e.worker);
            prop_assert_eq!(ea, eb, "query {:?}", query);
            check_last_external(a.device(), &query, hashes);
        }
        // One dump/restore normalizes the tree (ownerless nodes kept alive only by stale
        // hash references vanish); after that dumping is a fixed point.
        let again = SharedKvIndex::new(KvIndex::with_block_size(16));
        again.restore(&copy.snapshot_operations());
        prop_assert_eq!(again.snapshot_operations(), copy.snapshot_operations());
        // The copy keeps each worker's own hashes: later events (removals by those hashes,
        // stores under them as parents) apply to it as to the original.
        let mut copy_model = model.reachable();
        for op in &later {
            apply(&mut model, &mut idx, op, hashes);
            apply(&mut copy_model, &mut copy, op, hashes);
        }
        let mut out = OverlapScores::new();
        // (Blocks the dump left out as unreachable stay out of the copy even when a later
        // store fills the gap above them, hence its own model.)
        for query in queries_of(&model, &queries) {
            prop_assert_eq!(index_scores(&copy, &query, &mut out), copy_model.scores(&query), "copy, query {:?}", query);
            check_last_external(&out, &query, hashes);
            prop_assert_eq!(index_scores(&idx, &query, &mut out), model.scores(&query), "query {:?}", query);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_dump(&bytes, &DecodeLimits::default());
    }
}

/// An operation of the capacity test: the event-fed ones, or a (re)declared capacity.
#[derive(Clone, Debug)]
enum CapOp {
    Event(Op),
    SetCapacity(u8, Option<u8>),
}

fn cap_op_strategy() -> impl Strategy<Value = CapOp> {
    prop_oneof![
        12 => op_strategy().prop_map(CapOp::Event),
        1 => (any::<u8>(), prop::option::of(1u8..6)).prop_map(|(w, c)| CapOp::SetCapacity(w, c)),
    ]
}

/// Brings `model` down to what `idx` still holds (its capacity evictions), checking that
/// every evicted block was a leaf of what its worker keeps, and returns the number of
/// blocks evicted per worker.
fn restrict_to_retained(model: &mut Model, idx: &KvIndex) -> BTreeMap<WorkerKey, u64> {
    let mut evicted = BTreeMap::new();
    for (&worker, mw) in &mut model.workers {
        let gone: Vec<Vec<u64>> = mw
            .owned
            .iter()
            .filter(|p| !idx.primary().holds(worker, &q(p)))
            .cloned()
            .collect();
        for p in &gone {
            mw.owned.remove(p);
            mw.map.retain(|_, v| v != p);
        }
        for p in &gone {
            let child_kept = mw
                .owned
                .iter()
                .any(|c| c.len() == p.len() + 1 && c.starts_with(p));
            assert!(!child_kept, "{worker:?} lost {p:?} but kept a child of it");
        }
        *evicted.entry(worker).or_insert(0) += gone.len() as u64;
    }
    model
        .workers
        .retain(|_, mw| !mw.owned.is_empty() || !mw.map.is_empty());
    evicted
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// `total_kv_blocks` bounds a worker's blocks: the bound holds after every operation,
    /// evictions take only blocks whose children the worker no longer holds, and queries
    /// answer like the model restricted to the retained blocks (with the evicted blocks'
    /// hashes forgotten, so later removals and parents agree too). The evictions counted
    /// per worker are exactly the blocks that went.
    #[test]
    fn capacity_bounded_index_matches_model_restricted_to_retained_blocks(
        caps in prop::collection::vec(prop::option::of(1u8..6), 6),
        ops in prop::collection::vec(cap_op_strategy(), 1..60),
        queries in prop::collection::vec(prop::collection::vec(0u8..3, 0..6), 1..8),
        hashes in Hashes::any(),
    ) {
        let mut model = Model::default();
        let mut idx = KvIndex::with_block_size(4);
        let mut out = OverlapScores::new();
        let mut declared: BTreeMap<WorkerKey, u32> = BTreeMap::new();
        let mut counted: BTreeMap<WorkerKey, u64> = BTreeMap::new();
        let mut total = 0;
        for (i, cap) in caps.iter().enumerate() {
            if let Some(c) = cap {
                let worker = worker_of(i as u8);
                idx.set_capacity(worker, Some(u32::from(*c)));
                declared.insert(worker, u32::from(*c));
                counted.insert(worker, 0);
            }
        }
        for op in &ops {
            match op {
                CapOp::Event(op) => {
                    apply(&mut model, &mut idx, op, hashes);
                    match op {
                        Op::RemoveWorkerId(wi) => {
                            let id = worker_of(*wi).worker_id;
                            declared.retain(|k, _| k.worker_id != id);
                            counted.retain(|k, _| k.worker_id != id);
                        }
                        Op::RemoveRank(wi) => {
                            declared.remove(&worker_of(*wi));
                            counted.remove(&worker_of(*wi));
                        }
                        _ => {}
                    }
                }
                CapOp::SetCapacity(wi, c) => {
                    let worker = worker_of(*wi);
                    idx.set_capacity(worker, c.map(u32::from));
                    match c {
                        Some(c) => {
                            declared.insert(worker, u32::from(*c));
                            counted.entry(worker).or_insert(0);
                        }
                        None => {
                            declared.remove(&worker);
                            counted.remove(&worker);
                        }
                    }
                }
            }
            for (worker, n) in restrict_to_retained(&mut model, &idx) {
                total += n;
                if n > 0 {
                    prop_assert!(declared.contains_key(&worker), "{:?} evicted without a capacity", worker);
                    *counted.entry(worker).or_insert(0) += n;
                }
            }
            for (&worker, &limit) in &declared {
                prop_assert!(idx.primary().worker_blocks(worker) <= limit, "{:?} over {} after {:?}", worker, limit, op);
            }
            let reported: BTreeMap<WorkerKey, u64> = idx.primary().capacity_evictions().collect();
            prop_assert_eq!(&reported, &counted, "after {:?}", op);
            prop_assert_eq!(idx.counters().capacity_evicted, total);
            for query in queries_of(&model, &queries) {
                prop_assert_eq!(index_scores(&idx, &query, &mut out), model.scores(&query), "query {:?} after {:?}", query, op);
                check_last_external(&out, &query, hashes);
            }
        }
        for id in 0..3 {
            idx.remove_worker(WorkerId(id));
        }
        prop_assert_eq!(idx.primary_stats(), kv_index::PrefixIndexStats::default());
        prop_assert_eq!(idx.primary().capacity_evictions().count(), 0);
    }
}
