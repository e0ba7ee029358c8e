//! The pending-selection cache (`spec/service-semantics.md` §7): booking inputs captured by
//! `/select` with a `selection_id`, replayed by `POST /reservations` without the prompt.
//!
//! Bounded three ways (TTL, entry count, approximate bytes); oldest entries go first. Lookup
//! never removes; removal after a successful replay is guarded by the generation looked up,
//! so a newer `/select` for the same key that raced the replay survives.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kv_types::{BlockHash, SequenceHash, WorkerKey};

/// Bounds of the cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectionCacheConfig {
    pub ttl: Duration,
    pub max_entries: usize,
    pub max_bytes: usize,
}

impl Default for SelectionCacheConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_entries: 4096,
            max_bytes: 268_435_456,
        }
    }
}

/// `(model_name, routing_group, selection_id)`.
pub(crate) type PendingKey = (String, String, String);

/// What a replay books.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PendingSelection {
    pub(crate) worker: WorkerKey,
    pub(crate) tracking_hashes: Vec<SequenceHash>,
    pub(crate) isl: u64,
    pub(crate) effective_prefill_tokens: u64,
    pub(crate) expected_output_tokens: Option<u32>,
    pub(crate) track_prefill: bool,
    pub(crate) lora_name: Option<String>,
    /// Retained only when the partition records routing decisions.
    pub(crate) block_hashes: Vec<BlockHash>,
    pub(crate) session_id: Option<String>,
    /// The selection's routing-loss figures, counted when the replay books.
    pub(crate) routing: crate::routing_stats::RoutingSample,
}

#[derive(Debug)]
struct Entry {
    value: PendingSelection,
    generation: u64,
    inserted: Instant,
    bytes: usize,
}

/// The cache. Not internally synchronized: the service wraps it in one short mutex.
#[derive(Debug)]
pub(crate) struct PendingCache {
    config: SelectionCacheConfig,
    entries: HashMap<PendingKey, Entry>,
    /// generation -> key, i.e. insertion (age) order.
    order: BTreeMap<u64, PendingKey>,
    next_generation: u64,
    bytes: usize,
}

impl PendingCache {
    pub(crate) fn new(config: SelectionCacheConfig) -> Self {
        Self {
            config,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_generation: 0,
            bytes: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Inserts (latest wins), after sweeping expired entries; then evicts oldest-first
    /// until within bounds. Returns what went: entries past their TTL (never replayed)
    /// and entries evicted for space.
    pub(crate) fn insert(
        &mut self,
        key: PendingKey,
        value: PendingSelection,
        now: Instant,
    ) -> Dropped {
        let expired = self.sweep(now);
        let bytes = entry_size(&key, &value);
        self.remove_key(&key);
        let generation = self.next_generation;
        self.next_generation += 1;
        self.order.insert(generation, key.clone());
        self.entries.insert(
            key,
            Entry {
                value,
                generation,
                inserted: now,
                bytes,
            },
        );
        self.bytes += bytes;
        let mut evicted = 0;
        while self.entries.len() > self.config.max_entries || self.bytes > self.config.max_bytes {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.bytes;
                evicted += 1;
            }
        }
        Dropped { expired, evicted }
    }

    /// A live entry and its generation; entries older than the TTL count as absent.
    pub(crate) fn get(&self, key: &PendingKey, now: Instant) -> Option<(PendingSelection, u64)> {
        let e = self.entries.get(key)?;
        if now.saturating_duration_since(e.inserted) > self.config.ttl {
            return None;
        }
        Some((e.value.clone(), e.generation))
    }

    /// Removes the entry only if it is still the generation that was looked up.
    pub(crate) fn consume(&mut self, key: &PendingKey, generation: u64) -> bool {
        match self.entries.get(key) {
            Some(e) if e.generation == generation => {
                self.remove_key(key);
                true
            }
            _ => false,
        }
    }

    /// Unconditional discard (explicit reservations). Returns whether the entry it removed
    /// was already past its TTL (a selection that expired unused, for the counter).
    pub(crate) fn discard(&mut self, key: &PendingKey, now: Instant) -> bool {
        let expired = self
            .entries
            .get(key)
            .is_some_and(|e| now.saturating_duration_since(e.inserted) > self.config.ttl);
        self.remove_key(key);
        expired
    }

    fn remove_key(&mut self, key: &PendingKey) {
        if let Some(e) = self.entries.remove(key) {
            self.order.remove(&e.generation);
            self.bytes -= e.bytes;
        }
    }

    /// Removes the entries past their TTL; returns how many. Runs on every insert and in
    /// the service's periodic expiry pass, so expired entries are counted without new
    /// selections.
    pub(crate) fn sweep(&mut self, now: Instant) -> usize {
        let mut swept = 0;
        while let Some((&generation, key)) = self.order.first_key_value() {
            let expired = self
                .entries
                .get(key)
                .is_none_or(|e| now.saturating_duration_since(e.inserted) > self.config.ttl);
            if !expired {
                break;
            }
            let key = key.clone();
            self.order.remove(&generation);
            if let Some(e) = self.entries.remove(&key) {
                self.bytes -= e.bytes;
                swept += 1;
            }
        }
        swept
    }
}

/// The entries an [`PendingCache::insert`] removed besides the one it replaced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Dropped {
    /// Past the TTL: selected, never replayed.
    pub(crate) expired: usize,
    /// Oldest first, to stay within the entry and byte limits.
    pub(crate) evicted: usize,
}

/// The spec's size estimate of an entry, in bytes.
fn entry_size(key: &PendingKey, v: &PendingSelection) -> usize {
    8 * v.tracking_hashes.len()
        + 8 * v.block_hashes.len()
        + key.2.len()
        + key.0.len()
        + key.1.len()
        + v.lora_name.as_deref().map_or(0, str::len)
        + v.session_id.as_deref().map_or(0, str::len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> PendingKey {
        ("m".into(), "g".into(), id.into())
    }

    fn value(worker: u64, n_hashes: usize) -> PendingSelection {
        PendingSelection {
            worker: WorkerKey::new(worker, 0),
            tracking_hashes: (0..n_hashes as u64).map(SequenceHash).collect(),
            isl: 16,
            effective_prefill_tokens: 16,
            expected_output_tokens: None,
            track_prefill: true,
            lora_name: None,
            block_hashes: vec![],
            session_id: None,
            routing: crate::routing_stats::RoutingSample::default(),
        }
    }

    fn cache(ttl_secs: u64, max_entries: usize, max_bytes: usize) -> PendingCache {
        PendingCache::new(SelectionCacheConfig {
            ttl: Duration::from_secs(ttl_secs),
            max_entries,
            max_bytes,
        })
    }

    #[test]
    fn latest_wins_and_moves_to_the_back() {
        let t0 = Instant::now();
        let mut c = cache(120, 2, usize::MAX);
        c.insert(key("a"), value(1, 1), t0);
        c.insert(key("b"), value(2, 1), t0);
        c.insert(key("a"), value(3, 1), t0);
        c.insert(key("c"), value(4, 1), t0);
        // "b" was the oldest after "a" was replaced.
        assert!(c.get(&key("b"), t0).is_none());
        assert_eq!(
            c.get(&key("a"), t0).map(|(v, _)| v.worker.worker_id.0),
            Some(3)
        );
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn ttl_hides_before_sweep_and_sweeps_on_insert() {
        let t0 = Instant::now();
        let mut c = cache(10, 100, usize::MAX);
        c.insert(key("a"), value(1, 4), t0);
        assert!(c.get(&key("a"), t0 + Duration::from_secs(10)).is_some());
        assert!(c.get(&key("a"), t0 + Duration::from_secs(11)).is_none());
        assert_eq!(c.len(), 1);
        let dropped = c.insert(key("b"), value(1, 4), t0 + Duration::from_secs(11));
        assert_eq!(
            dropped,
            Dropped {
                expired: 1,
                evicted: 0
            }
        );
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn byte_budget_evicts_oldest_and_oversized_entries_evict_themselves() {
        let t0 = Instant::now();
        // key bytes = 1 + 1 + 1 = 3, plus 8 per hash.
        let mut c = cache(120, 100, 3 + 8 * 4 + 3 + 8 * 4);
        c.insert(key("a"), value(1, 4), t0);
        c.insert(key("b"), value(1, 4), t0);
        assert_eq!(c.len(), 2);
        c.insert(key("c"), value(1, 1), t0);
        assert!(c.get(&key("a"), t0).is_none());
        assert_eq!(c.bytes(), 35 + 11);
        assert_eq!(
            c.insert(key("huge"), value(1, 1000), t0),
            Dropped {
                expired: 0,
                evicted: 3
            }
        );
        assert_eq!(c.len(), 0);
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn consume_is_generation_guarded() {
        let t0 = Instant::now();
        let mut c = cache(120, 100, usize::MAX);
        c.insert(key("a"), value(1, 1), t0);
        let (_, generation) = c.get(&key("a"), t0).unwrap();
        c.insert(key("a"), value(2, 1), t0);
        assert!(!c.consume(&key("a"), generation));
        let (v, newer) = c.get(&key("a"), t0).unwrap();
        assert_eq!(v.worker.worker_id.0, 2);
        assert!(c.consume(&key("a"), newer));
        assert!(c.get(&key("a"), t0).is_none());
        assert_eq!(c.bytes(), 0);
    }
}
