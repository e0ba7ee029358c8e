//! Filtering, namespace propagation and conversion of decoded events into index operations
//! (`spec/kv-events.md` §6–§7). One [`Normalizer`] per listener: its learned group kinds and
//! cache namespaces are per publisher stream.

use std::sync::Arc;

use kv_types::{
    BlockHash, DpRank, HashOptions, KvOperation, KvOperationKind, StorageTier, StoredBlock,
    WorkerId, WorkerKey, block_hashes_into, window_count,
};
use rustc_hash::FxHashMap;

use crate::decode::{BlockStored, CacheSpecKind, DecodeError, EventBatch, GroupMeta, Locality};
use crate::decode::{RawEvent, decode_batch_reusing};
use crate::spares::Spares;

/// Why an event was skipped while the rest of its batch was applied (§6.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FilterReason {
    IgnoredEvent,
    NonLocalLocality,
    UnknownMedium,
    UnsupportedOwnership,
    UnknownOwnership,
    AmbiguousCacheNamespace,
    NonMainAttentionKind,
    UnknownKind,
    NonMainAttentionGroup,
    UnlearnedGroupIdx,
}

impl FilterReason {
    pub const ALL: [FilterReason; 10] = [
        FilterReason::IgnoredEvent,
        FilterReason::NonLocalLocality,
        FilterReason::UnknownMedium,
        FilterReason::UnsupportedOwnership,
        FilterReason::UnknownOwnership,
        FilterReason::AmbiguousCacheNamespace,
        FilterReason::NonMainAttentionKind,
        FilterReason::UnknownKind,
        FilterReason::NonMainAttentionGroup,
        FilterReason::UnlearnedGroupIdx,
    ];

    /// The metric label of the spec.
    pub const fn as_str(self) -> &'static str {
        match self {
            FilterReason::IgnoredEvent => "ignored_event",
            FilterReason::NonLocalLocality => "non_local_locality",
            FilterReason::UnknownMedium => "unknown_medium",
            FilterReason::UnsupportedOwnership => "unsupported_ownership",
            FilterReason::UnknownOwnership => "unknown_ownership",
            FilterReason::AmbiguousCacheNamespace => "ambiguous_cache_namespace",
            FilterReason::NonMainAttentionKind => "non_main_attention_kind",
            FilterReason::UnknownKind => "unknown_kind",
            FilterReason::NonMainAttentionGroup => "non_main_attention_group",
            FilterReason::UnlearnedGroupIdx => "unlearned_group_idx",
        }
    }

    /// Dense index into [`Self::ALL`], for counter arrays.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Why blocks of an accepted `BlockStored` were not stored (§7.1): the event is applied,
/// but these blocks are not, so they are counted apart from whole-event filters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TruncateReason {
    /// The event's `block_size` is not the worker's registered one: every block.
    BlockSizeMismatch,
    /// Fewer tokens than the listed blocks need: the blocks past the last complete window.
    MissingTokens,
    /// A block hash repeats (or repeats the parent): the whole store is a no-op.
    SelfReference,
}

impl TruncateReason {
    pub const ALL: [TruncateReason; 3] = [
        TruncateReason::BlockSizeMismatch,
        TruncateReason::MissingTokens,
        TruncateReason::SelfReference,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            TruncateReason::BlockSizeMismatch => "block_size_mismatch",
            TruncateReason::MissingTokens => "missing_tokens",
            TruncateReason::SelfReference => "self_reference",
        }
    }

    /// Dense index into [`Self::ALL`], for counter arrays.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Cache namespace of one external block hash (§6.4).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Namespace {
    Salted(Arc<str>),
    Ambiguous,
}

/// Logs the first few occurrences of a condition, then only at powers of two, so a publisher
/// that repeats a mistake every batch cannot flood the log. Clock-free on purpose.
#[derive(Debug, Default)]
pub(crate) struct LogLimiter {
    count: u64,
}

impl LogLimiter {
    pub(crate) fn allow(&mut self) -> bool {
        self.count = self.count.saturating_add(1);
        self.count <= 3 || self.count.is_power_of_two()
    }

    pub(crate) fn count(&self) -> u64 {
        self.count
    }
}

/// Turns decoded batches of one publisher stream into [`KvOperation`]s.
#[derive(Debug)]
pub struct Normalizer {
    worker_id: WorkerId,
    registered_rank: DpRank,
    block_size: u32,
    /// Learned `(dp_rank, group_idx) → kind`.
    groups: FxHashMap<(u32, u32), CacheSpecKind>,
    /// `(dp_rank, external hash) → namespace`.
    namespaces: FxHashMap<(u32, u64), Namespace>,
    /// The last explicit salt, reused so a tenant's blocks share one allocation.
    last_salt: Option<Arc<str>>,
    block_size_log: LogLimiter,
    self_ref_log: LogLimiter,
    scratch_hashes: Vec<BlockHash>,
    scratch_sorted: Vec<u64>,
    /// Blocks not stored since the last [`Self::take_truncated`], by [`TruncateReason`].
    truncated: [u64; TruncateReason::ALL.len()],
}

impl Normalizer {
    /// The blocks dropped from stores (by [`TruncateReason::index`]) since the last call,
    /// and resets them. A caller that discards a batch after an error discards these too.
    pub fn take_truncated(&mut self) -> [u64; TruncateReason::ALL.len()] {
        std::mem::take(&mut self.truncated)
    }

    /// `block_size` is the worker's registered block size, used for re-hashing stored tokens.
    pub fn new(worker: WorkerKey, block_size: u32) -> Self {
        Self {
            worker_id: worker.worker_id,
            registered_rank: worker.dp_rank,
            block_size,
            groups: FxHashMap::default(),
            namespaces: FxHashMap::default(),
            last_salt: None,
            block_size_log: LogLimiter::default(),
            self_ref_log: LogLimiter::default(),
            scratch_hashes: Vec::new(),
            scratch_sorted: Vec::new(),
            truncated: [0; TruncateReason::ALL.len()],
        }
    }

    /// Decodes `payload` and normalizes it with [`Self::normalize_batch`]. On a decode error
    /// nothing is appended and no state changes.
    pub fn process_payload(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut Vec<KvOperation>,
        on_filtered: impl FnMut(FilterReason),
    ) -> Result<(), DecodeError> {
        self.process_payload_reusing(payload, seq, out, &mut Spares::default(), on_filtered)
    }

    /// [`Self::process_payload`], taking the vectors of the decoded events and of the
    /// operations from `spares` and giving the events' back (see [`Spares`]).
    pub fn process_payload_reusing(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut Vec<KvOperation>,
        spares: &mut Spares,
        on_filtered: impl FnMut(FilterReason),
    ) -> Result<(), DecodeError> {
        let batch = decode_batch_reusing(payload, spares)?;
        self.normalize_with(&batch, seq, out, spares, on_filtered);
        batch.give_back(spares);
        Ok(())
    }

    /// Filters and converts every event of `batch` in order, appending one operation per
    /// accepted event to `out` (with `event_id = seq`) and reporting each skipped event.
    pub fn normalize_batch(
        &mut self,
        batch: &EventBatch<'_>,
        seq: u64,
        out: &mut Vec<KvOperation>,
        on_filtered: impl FnMut(FilterReason),
    ) {
        self.normalize_with(batch, seq, out, &mut Spares::default(), on_filtered);
    }

    fn normalize_with(
        &mut self,
        batch: &EventBatch<'_>,
        seq: u64,
        out: &mut Vec<KvOperation>,
        spares: &mut Spares,
        mut on_filtered: impl FnMut(FilterReason),
    ) {
        let rank = batch.dp_rank.map_or(self.registered_rank, DpRank);
        let worker = WorkerKey {
            worker_id: self.worker_id,
            dp_rank: rank,
        };
        for event in &batch.events {
            match self.event(event, worker, seq, spares) {
                Ok(op) => out.push(op),
                Err(reason) => on_filtered(reason),
            }
        }
    }

    /// Forgets learned groups and namespaces (e.g. after the service removed the worker's
    /// blocks).
    pub fn reset(&mut self) {
        self.groups.clear();
        self.namespaces.clear();
        self.last_salt = None;
    }

    fn event(
        &mut self,
        event: &RawEvent<'_>,
        worker: WorkerKey,
        seq: u64,
        spares: &mut Spares,
    ) -> Result<KvOperation, FilterReason> {
        let rank = worker.dp_rank.0;
        let op = |tier, kind| KvOperation {
            worker,
            tier,
            event_id: seq,
            kind,
        };
        match event {
            RawEvent::Ignored => Err(FilterReason::IgnoredEvent),
            RawEvent::Cleared(c) => {
                check_ownership(c.ownership)?;
                self.namespaces.retain(|&(r, _), _| r != rank);
                Ok(op(StorageTier::Device, KvOperationKind::Cleared))
            }
            RawEvent::Removed(ev) => {
                let tier = check_provenance(&ev.meta, ev.medium)?;
                let mut block_hashes = spares.hashes();
                block_hashes.extend_from_slice(&ev.block_hashes);
                if lower_tier_without_metadata(tier) {
                    return Ok(op(tier, KvOperationKind::Removed { block_hashes }));
                }
                self.group_filter(rank, &ev.meta)?;
                for h in &ev.block_hashes {
                    if let Some(Namespace::Salted(_)) = self.namespaces.get(&(rank, h.0)) {
                        self.namespaces.remove(&(rank, h.0));
                    }
                }
                Ok(op(tier, KvOperationKind::Removed { block_hashes }))
            }
            RawEvent::Stored(ev) => {
                let tier = check_provenance(&ev.meta, ev.medium)?;
                if lower_tier_without_metadata(tier) {
                    let salt = ev.cache_salt;
                    return Ok(op(tier, self.convert_stored(ev, salt, spares)));
                }
                if let (Some(g), Some(kind)) = (ev.meta.group_idx, ev.meta.kind) {
                    self.groups.insert((rank, g), kind);
                }
                self.group_filter(rank, &ev.meta)?;
                let salt = self.propagate_namespace(rank, ev)?;
                Ok(op(tier, self.convert_stored(ev, salt.as_deref(), spares)))
            }
        }
    }

    /// Step 6 of §6.1.
    fn group_filter(&self, rank: u32, meta: &GroupMeta<'_>) -> Result<(), FilterReason> {
        let classify = |kind: CacheSpecKind, non_main| {
            if kind == CacheSpecKind::Unknown {
                Err(FilterReason::UnknownKind)
            } else if kind.is_main_attention() {
                Ok(())
            } else {
                Err(non_main)
            }
        };
        if let Some(kind) = meta.kind {
            return classify(kind, FilterReason::NonMainAttentionKind);
        }
        if let Some(g) = meta.group_idx {
            return match self.groups.get(&(rank, g)) {
                Some(&kind) => classify(kind, FilterReason::NonMainAttentionGroup),
                None if g == 0 => Ok(()),
                None => Err(FilterReason::UnlearnedGroupIdx),
            };
        }
        Ok(())
    }

    /// Step 7 of §6.1 for stores: the namespace the event is hashed under.
    fn propagate_namespace(
        &mut self,
        rank: u32,
        ev: &BlockStored<'_>,
    ) -> Result<Option<Arc<str>>, FilterReason> {
        let ns = if let Some(salt) = ev.cache_salt {
            Some(self.intern(salt))
        } else if let Some(parent) = ev.parent_block_hash {
            match self.namespaces.get(&(rank, parent.0)) {
                Some(Namespace::Salted(s)) => Some(Arc::clone(s)),
                Some(Namespace::Ambiguous) => return Err(FilterReason::AmbiguousCacheNamespace),
                // Fail open: a listener that joined mid-chain cannot know the parent's salt.
                None => None,
            }
        } else {
            None
        };
        match &ns {
            Some(salt) => {
                for h in &ev.block_hashes {
                    self.namespaces
                        .entry((rank, h.0))
                        .and_modify(|e| {
                            if !matches!(e, Namespace::Salted(s) if s == salt) {
                                *e = Namespace::Ambiguous;
                            }
                        })
                        .or_insert_with(|| Namespace::Salted(Arc::clone(salt)));
                }
            }
            None => {
                for h in &ev.block_hashes {
                    if let Some(e) = self.namespaces.get_mut(&(rank, h.0)) {
                        *e = Namespace::Ambiguous;
                    }
                }
            }
        }
        Ok(ns)
    }

    fn intern(&mut self, salt: &str) -> Arc<str> {
        match &self.last_salt {
            Some(s) if &**s == salt => Arc::clone(s),
            _ => {
                let s: Arc<str> = Arc::from(salt);
                self.last_salt = Some(Arc::clone(&s));
                s
            }
        }
    }

    /// §7.1: self-reference check, block-size check, re-hashing of every complete block.
    fn convert_stored(
        &mut self,
        ev: &BlockStored<'_>,
        salt: Option<&str>,
        spares: &mut Spares,
    ) -> KvOperationKind {
        if self.has_self_reference(ev) {
            self.truncated[TruncateReason::SelfReference.index()] += ev.block_hashes.len() as u64;
            if self.self_ref_log.allow() {
                tracing::warn!(
                    worker_id = self.worker_id.0,
                    occurrences = self.self_ref_log.count(),
                    "BlockStored repeats a block hash (or its parent); applied as a no-op"
                );
            }
            return KvOperationKind::Removed {
                block_hashes: Vec::new(),
            };
        }
        let b = self.block_size;
        let count = if ev.block_size != u64::from(b) {
            if self.block_size_log.count() < 3 {
                tracing::warn!(
                    worker_id = self.worker_id.0,
                    event_block_size = ev.block_size,
                    registered_block_size = b,
                    "BlockStored block_size differs from the registered one; blocks dropped"
                );
            }
            self.block_size_log.allow();
            self.truncated[TruncateReason::BlockSizeMismatch.index()] +=
                ev.block_hashes.len() as u64;
            0
        } else {
            let complete =
                ev.block_hashes
                    .len()
                    .min(window_count(ev.token_ids.len(), b, ev.is_eagle));
            self.truncated[TruncateReason::MissingTokens.index()] +=
                (ev.block_hashes.len() - complete) as u64;
            complete
        };
        let mut blocks = spares.blocks();
        blocks.reserve(count);
        if count > 0 {
            let needed = count * b as usize + usize::from(ev.is_eagle);
            let mm = ev.block_mm_infos.as_deref().unwrap_or(&[]);
            let opts = HashOptions {
                lora_name: ev.lora_name,
                cache_salt: salt,
                is_eagle: ev.is_eagle,
                block_mm_infos: mm,
            };
            block_hashes_into(&ev.token_ids[..needed], b, &opts, &mut self.scratch_hashes);
            for (i, (&block_hash, &tokens_hash)) in ev
                .block_hashes
                .iter()
                .zip(self.scratch_hashes.iter())
                .enumerate()
            {
                blocks.push(StoredBlock {
                    block_hash,
                    tokens_hash,
                    mm_extra_info: mm.get(i).cloned().flatten(),
                });
            }
        }
        KvOperationKind::Stored {
            parent_hash: ev.parent_block_hash,
            blocks,
        }
    }

    fn has_self_reference(&mut self, ev: &BlockStored<'_>) -> bool {
        let sorted = &mut self.scratch_sorted;
        sorted.clear();
        sorted.extend(ev.parent_block_hash.iter().map(|h| h.0));
        sorted.extend(ev.block_hashes.iter().map(|h| h.0));
        sorted.sort_unstable();
        sorted.windows(2).any(|w| w[0] == w[1])
    }
}

/// Disk and external tiers skip group filtering and namespace propagation (§6.1 step 4).
fn lower_tier_without_metadata(tier: StorageTier) -> bool {
    matches!(tier, StorageTier::Disk | StorageTier::External)
}

fn check_ownership(ownership: Option<&str>) -> Result<(), FilterReason> {
    match ownership {
        None => Ok(()),
        Some("kvcr") => Err(FilterReason::UnsupportedOwnership),
        Some(_) => Err(FilterReason::UnknownOwnership),
    }
}

/// Steps 1, 3 and 4 of §6.1 (the `Ignored` tag never reaches here).
fn check_provenance(
    meta: &GroupMeta<'_>,
    medium: Option<&str>,
) -> Result<StorageTier, FilterReason> {
    check_ownership(meta.ownership)?;
    match meta.locality {
        None | Some(Locality::Local) => {}
        Some(Locality::Remote | Locality::Unknown) => return Err(FilterReason::NonLocalLocality),
    }
    StorageTier::from_medium(medium).ok_or(FilterReason::UnknownMedium)
}

#[cfg(test)]
mod tests {
    use kv_types::{ExternalHash, StorageTier};

    use super::*;
    use crate::decode::decode_batch;

    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
            .collect()
    }

    /// Listener of the spec's examples: worker 7, rank 0, block size 4.
    fn normalizer() -> Normalizer {
        Normalizer::new(WorkerKey::new(7, 0), 4)
    }

    fn run(n: &mut Normalizer, payload: &[u8]) -> (Vec<KvOperation>, Vec<FilterReason>) {
        let mut ops = Vec::new();
        let mut filtered = Vec::new();
        n.process_payload(payload, 42, &mut ops, |r| filtered.push(r))
            .expect("decodes");
        (ops, filtered)
    }

    fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvOperationKind {
        KvOperationKind::Stored {
            parent_hash: parent.map(ExternalHash),
            blocks: blocks
                .iter()
                .map(|&(e, t)| StoredBlock::new(ExternalHash(e), BlockHash(t)))
                .collect(),
        }
    }

    fn op(rank: u32, tier: StorageTier, kind: KvOperationKind) -> KvOperation {
        KvOperation {
            worker: WorkerKey::new(7, rank),
            tier,
            event_id: 42,
            kind,
        }
    }

    /// Runs one hex example and compares with the expected operations and filter reasons;
    /// then twice more through one [`Spares`], the second time with the vectors the first
    /// gave back, as a listener group does.
    fn check(hex_payload: &str, expected: &[KvOperation], expected_filtered: &[FilterReason]) {
        let (ops, filtered) = run(&mut normalizer(), &hex(hex_payload));
        assert_eq!(ops, expected);
        assert_eq!(filtered, expected_filtered);
        let mut spares = Spares::default();
        for pass in 0..2 {
            let (mut ops, mut filtered) = (Vec::new(), Vec::new());
            normalizer()
                .process_payload_reusing(&hex(hex_payload), 42, &mut ops, &mut spares, |r| {
                    filtered.push(r)
                })
                .expect("decodes");
            assert_eq!(ops, expected, "reusing, pass {pass}");
            assert_eq!(filtered, expected_filtered, "reusing, pass {pass}");
            spares.recycle(&mut ops);
        }
    }

    #[test]
    fn a_batch_gives_its_vectors_back() {
        let payload = hex(
            "93 cb 3f f8 00 00 00 00 00 00 91 97 ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             92 65 66 c0 98 01 02 03 04 05 06 07 08 04 c0 a3 47 50 55 00",
        );
        let mut spares = Spares::default();
        let mut ops = Vec::new();
        normalizer()
            .process_payload_reusing(&payload, 1, &mut ops, &mut spares, |_| {})
            .expect("decodes");
        // The event's token ids and engine hashes; its blocks are in the operation.
        assert_eq!(spares.kept(), (1, 1, 0));
        spares.recycle(&mut ops);
        assert_eq!(spares.kept(), (1, 1, 1));
        normalizer()
            .process_payload_reusing(&payload, 2, &mut ops, &mut spares, |_| {})
            .expect("decodes");
        // Each vector came from the spares and went back.
        assert_eq!(spares.kept(), (1, 1, 0));
        assert_eq!(ops.len(), 1);
    }

    const H1_A: u64 = 14643705804678351452;
    const H1_B: u64 = 16777012769546811212;

    #[test]
    fn golden_12_1_live_message() {
        let payload = hex(
            "93 cb 3f f8 00 00 00 00 00 00 91 97 ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             92 65 66 c0 98 01 02 03 04 05 06 07 08 04 c0 a3 47 50 55 00",
        );
        let seq = hex("00 00 00 00 00 00 00 07");
        let msg = crate::decode::parse_live_frames(&[&[], &seq, &payload]).expect("framing");
        assert_eq!(msg.seq, 7);
        assert!(msg.topic.is_empty());
        let (ops, _) = run(&mut normalizer(), msg.payload);
        assert_eq!(ops.len(), 1);
    }

    /// Blocks an applied store leaves out are counted by reason, once, and reset by
    /// `take_truncated`.
    #[test]
    fn truncated_blocks_are_counted_by_reason() {
        // One positional BlockStored: hashes, parent nil, tokens, block size, lora nil, GPU.
        let store = |hashes: &str, tokens: &str, block_size: &str| {
            hex(&format!(
                "93 cb 3f f8 00 00 00 00 00 00 91 97 ab 42 6c 6f 63 6b 53 74 6f 72 65 64
                 {hashes} c0 {tokens} {block_size} c0 a3 47 50 55 00"
            ))
        };
        let eight_tokens = "98 01 02 03 04 05 06 07 08";
        let counts = |payload: &[u8]| {
            let mut n = normalizer();
            let (ops, _) = run(&mut n, payload);
            assert_eq!(ops.len(), 1);
            let counts = n.take_truncated();
            assert_eq!(n.take_truncated(), [0; 3], "reset");
            counts
        };
        let idx = |r: TruncateReason| r.index();
        let mut want = [0; 3];
        assert_eq!(counts(&store("92 65 66", eight_tokens, "04")), want);
        want[idx(TruncateReason::BlockSizeMismatch)] = 2;
        assert_eq!(counts(&store("92 65 66", eight_tokens, "08")), want);
        want = [0; 3];
        want[idx(TruncateReason::MissingTokens)] = 1;
        assert_eq!(counts(&store("92 65 66", "94 01 02 03 04", "04")), want);
        want = [0; 3];
        want[idx(TruncateReason::SelfReference)] = 2;
        assert_eq!(counts(&store("92 65 65", eight_tokens, "04")), want);
    }

    #[test]
    fn golden_12_2_positional_stored() {
        check(
            "93 cb 3f f8 00 00 00 00 00 00 91 97 ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             92 65 66 c0 98 01 02 03 04 05 06 07 08 04 c0 a3 47 50 55 00",
            &[op(
                0,
                StorageTier::Device,
                stored(None, &[(101, H1_A), (102, H1_B)]),
            )],
            &[],
        );
    }

    #[test]
    fn golden_12_3_map_stored_negative_hash_host_tier() {
        check(
            "93 cb 40 00 00 00 00 00 00 00 91 87
             a4 74 79 70 65  ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             ac 62 6c 6f 63 6b 5f 68 61 73 68 65 73  91 fe
             b1 70 61 72 65 6e 74 5f 62 6c 6f 63 6b 5f 68 61 73 68  66
             a9 74 6f 6b 65 6e 5f 69 64 73  94 09 0a 0b 0c
             aa 62 6c 6f 63 6b 5f 73 69 7a 65  04
             a6 6d 65 64 69 75 6d  aa 43 50 55 5f 50 49 4e 4e 45 44
             a9 6c 6f 72 61 5f 6e 61 6d 65  c0
             c0",
            &[op(
                0,
                StorageTier::HostPinned,
                stored(Some(102), &[(18446744073709551614, 483935686894639516)]),
            )],
            &[],
        );
    }

    #[test]
    fn golden_12_4_removed_and_cleared_with_rank_override() {
        check(
            "93 cb 40 08 00 00 00 00 00 00 92
             93 ac 42 6c 6f 63 6b 52 65 6d 6f 76 65 64 92 65 66 a3 47 50 55
             91 b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65 64
             01",
            &[
                op(
                    1,
                    StorageTier::Device,
                    KvOperationKind::Removed {
                        block_hashes: vec![ExternalHash(101), ExternalHash(102)],
                    },
                ),
                op(1, StorageTier::Device, KvOperationKind::Cleared),
            ],
            &[],
        );
    }

    #[test]
    fn golden_12_5_fixed_tail_accepted() {
        check(
            "93 cb 40 10 00 00 00 00 00 00 91 9d ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             91 cd 01 2d c0 94 01 02 03 04 04 c0 c0 c0 c0
             00 ae 66 75 6c 6c 5f 61 74 74 65 6e 74 69 6f 6e c0 a5 4c 4f 43 41 4c c0",
            &[op(0, StorageTier::Device, stored(None, &[(301, H1_A)]))],
            &[],
        );
    }

    #[test]
    fn golden_12_6_sliding_window_filtered() {
        check(
            "93 cb 40 18 00 00 00 00 00 00 91 9d ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             91 cd 01 f5 c0 94 01 02 03 04 04 c0 c0 c0 c0
             01 ae 73 6c 69 64 69 6e 67 5f 77 69 6e 64 6f 77 cc 80 a5 4c 4f 43 41 4c c0",
            &[],
            &[FilterReason::NonMainAttentionKind],
        );
    }

    #[test]
    fn golden_12_7_sglang_salt_map() {
        check(
            "93 cb 40 14 00 00 00 00 00 00 91 98 ab 42 6c 6f 63 6b 53 74 6f 72 65 64
             91 cd 01 91 c0 94 01 02 03 04 04 c0 a3 47 50 55
             81 aa 63 61 63 68 65 5f 73 61 6c 74 a8 74 65 6e 61 6e 74 2d 61
             c0",
            &[op(
                0,
                StorageTier::Device,
                stored(None, &[(401, 5738685477468498325)]),
            )],
            &[],
        );
    }

    #[test]
    fn golden_12_8_edge_cases() {
        check(
            "93cb401c0000000000009186a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cd0259b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a86c6f63616c697479a652454d4f5445c0",
            &[],
            &[FilterReason::NonLocalLocality],
        );
        check(
            "93cb40200000000000009197ab426c6f636b53746f72656491cd02bdc0940102030404c0a24653c0",
            &[],
            &[FilterReason::UnknownMedium],
        );
        check(
            "93cb3ff00000000000009197ab426c6f636b53746f726564910bc09492010292020392030492040504c0a347505500",
            &[op(
                0,
                StorageTier::Device,
                stored(None, &[(11, 1914873892905420881)]),
            )],
            &[],
        );
        // Tokens short: only the first block.
        check(
            "93cb3ff00000000000009197ab426c6f636b53746f726564920b0cc09601020304050604c0a347505500",
            &[op(0, StorageTier::Device, stored(None, &[(11, H1_A)]))],
            &[],
        );
        // Parent repeats a block hash: empty Removed.
        check(
            "93cb3ff00000000000009197ab426c6f636b53746f726564920b0c0b98010203040506070804c0a347505500",
            &[op(
                0,
                StorageTier::Device,
                KvOperationKind::Removed {
                    block_hashes: vec![],
                },
            )],
            &[],
        );
        // Block size 8 ≠ 4: zero blocks.
        check(
            "93cb3ff00000000000009197ab426c6f636b53746f726564910bc098010203040506070808c0a347505500",
            &[op(0, StorageTier::Device, stored(None, &[]))],
            &[],
        );
    }

    #[test]
    fn golden_12_8_decode_errors() {
        let err = decode_batch(&hex("92099191b0416c6c426c6f636b73436c6561726564"))
            .expect_err("2-element batch");
        assert_eq!(err, DecodeError::BatchArity { len: 2 });
        // [1.0, [["Weird", 1]], 0]
        let weird = hex("93 cb3ff0000000000000 91 92 a5 5765697264 01 00");
        assert!(matches!(
            decode_batch(&weird),
            Err(DecodeError::UnknownEventType { tag }) if tag == "Weird"
        ));
        // [3, [["AllBlocksCleared"]], nil]: integer ts accepted.
        let int_ts = hex("93 03 91 91 b0416c6c426c6f636b73436c6561726564 c0");
        let batch = decode_batch(&int_ts).expect("int ts");
        assert_eq!(batch.ts, 3.0);
        assert_eq!(batch.events.len(), 1);
    }

    /// kv-events §4: the batch is a 3-element array, never a map. Each map form (named
    /// members, positional integer keys, map16, empty) is an undecodable batch of the wrong
    /// shape, so the listener drops it as `bad_batch_shape` and its watermark stays put.
    #[test]
    fn golden_12_8_map_batches_are_rejected() {
        let cleared = "91 91 b0416c6c426c6f636b73436c6561726564";
        let vectors = [
            // {"ts": 1.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": nil}
            format!(
                "83 a2 7473 cb3ff0000000000000 a6 6576656e7473 {cleared} \
                 b2 646174615f706172616c6c656c5f72616e6b c0"
            ),
            // {0: 1.0, 1: [["AllBlocksCleared"]], 2: nil}
            format!("83 00 cb3ff0000000000000 01 {cleared} 02 c0"),
            // The same as a map16.
            format!("de 0003 00 cb3ff0000000000000 01 {cleared} 02 c0"),
            // {}
            "80".to_owned(),
        ];
        for v in &vectors {
            let err = decode_batch(&hex(v)).expect_err(v);
            assert_eq!(
                err,
                DecodeError::WrongType {
                    field: "batch",
                    expected: "array",
                },
                "{v}"
            );
            assert_eq!(
                crate::DropReason::from(&err),
                crate::DropReason::BadBatchShape
            );
            // The normalizer fails the whole payload and emits no operation.
            let mut ops = Vec::new();
            let res = normalizer().process_payload(&hex(v), 42, &mut ops, |_| {});
            assert!(res.is_err(), "{v}");
            assert!(ops.is_empty(), "{v}");
        }
    }

    fn value_batch(events: Vec<rmpv::Value>) -> Vec<u8> {
        let v = rmpv::Value::Array(vec![
            rmpv::Value::F64(1.0),
            rmpv::Value::Array(events),
            rmpv::Value::Nil,
        ]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    fn store_ev(hashes: &[u64], parent: Option<u64>, salt: Option<&str>) -> rmpv::Value {
        use rmpv::Value;
        let mut m = vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
            ),
            (
                Value::from("token_ids"),
                Value::Array((0..4 * hashes.len() as u64).map(Value::from).collect()),
            ),
            (Value::from("block_size"), Value::from(4)),
            (
                Value::from("parent_block_hash"),
                parent.map_or(Value::Nil, Value::from),
            ),
        ];
        if let Some(salt) = salt {
            m.push((Value::from("cache_salt"), Value::from(salt)));
        }
        rmpv::Value::Map(m)
    }

    fn first_tokens_hash(ops: &[KvOperation]) -> u64 {
        match &ops[0].kind {
            KvOperationKind::Stored { blocks, .. } => blocks[0].tokens_hash.0,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn salt_propagates_to_children_and_ambiguity_filters() {
        let mut n = normalizer();
        let (root, _) = run(&mut n, &value_batch(vec![store_ev(&[1], None, Some("a"))]));
        assert_eq!(root.len(), 1);
        // Child without salt inherits "a": hashes like an explicitly salted child.
        let (child, _) = run(&mut n, &value_batch(vec![store_ev(&[2], Some(1), None)]));
        let (explicit, _) = run(
            &mut normalizer(),
            &value_batch(vec![store_ev(&[2], Some(1), Some("a"))]),
        );
        assert_eq!(first_tokens_hash(&child), first_tokens_hash(&explicit));
        // Block 2 stored again under another salt becomes ambiguous; its children are filtered.
        run(
            &mut n,
            &value_batch(vec![store_ev(&[2], Some(1), Some("b"))]),
        );
        let (ops, filtered) = run(&mut n, &value_batch(vec![store_ev(&[3], Some(2), None)]));
        assert!(ops.is_empty());
        assert_eq!(filtered, vec![FilterReason::AmbiguousCacheNamespace]);
        // Unknown parent: fail open, unsalted.
        let (ops, _) = run(&mut n, &value_batch(vec![store_ev(&[9], Some(99), None)]));
        assert_eq!(first_tokens_hash(&ops), unsalted_0123());
        // Cleared forgets the rank's namespaces.
        run(
            &mut n,
            &hex("93 03 91 91 b0416c6c426c6f636b73436c6561726564 c0"),
        );
        let (ops, filtered) = run(&mut n, &value_batch(vec![store_ev(&[3], Some(2), None)]));
        assert!(filtered.is_empty());
        assert_eq!(first_tokens_hash(&ops), unsalted_0123());
    }

    /// Local hash of tokens [0, 1, 2, 3] without salt or LoRA.
    fn unsalted_0123() -> u64 {
        kv_types::block_hashes(&[0, 1, 2, 3], 4, &HashOptions::default())[0].0
    }

    #[test]
    fn learned_groups_filter_later_events() {
        use rmpv::Value;
        let mut n = normalizer();
        let tail = |g: u64, kind: Value| {
            Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(10 + g)]),
                Value::Nil,
                Value::Array((1..=4u64).map(Value::from).collect()),
                Value::from(4),
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::from(g),
                kind,
                Value::Nil,
                Value::from("LOCAL"),
            ])
        };
        let (_, f) = run(&mut n, &value_batch(vec![tail(1, Value::from("mamba"))]));
        assert_eq!(f, vec![FilterReason::NonMainAttentionKind]);
        // group 1 learned as mamba: a kind-less event of group 1 is filtered by group.
        let (_, f) = run(&mut n, &value_batch(vec![tail(1, Value::Nil)]));
        assert_eq!(f, vec![FilterReason::NonMainAttentionGroup]);
        let (_, f) = run(&mut n, &value_batch(vec![tail(5, Value::Nil)]));
        assert_eq!(f, vec![FilterReason::UnlearnedGroupIdx]);
        let (ops, f) = run(&mut n, &value_batch(vec![tail(0, Value::Nil)]));
        assert!(f.is_empty());
        assert_eq!(ops.len(), 1);
        let (_, f) = run(
            &mut n,
            &value_batch(vec![tail(0, Value::from("brand_new_kind"))]),
        );
        assert_eq!(f, vec![FilterReason::UnknownKind]);
    }

    #[test]
    fn ownership_and_ignored_filters() {
        use rmpv::Value;
        let cleared = |o: &str| Value::Array(vec![Value::from("AllBlocksCleared"), Value::from(o)]);
        let (ops, f) = run(
            &mut normalizer(),
            &value_batch(vec![
                cleared("kvcr"),
                cleared("other"),
                Value::Array(vec![Value::from("Ignored")]),
            ]),
        );
        assert!(ops.is_empty());
        assert_eq!(
            f,
            vec![
                FilterReason::UnsupportedOwnership,
                FilterReason::UnknownOwnership,
                FilterReason::IgnoredEvent
            ]
        );
    }
}
