//! Hash tables that grow one small shard at a time, so no insert moves the whole table.
//!
//! A `hashbrown` table grows by moving every entry into a table twice its size, inside
//! the insert that crosses its load limit. Under the index's write lock that insert is what
//! a lookup waits for: a worker's block map of 229 k entries took 6.7 ms to grow (every
//! entry re-hashed through its node, a cache miss each) and the child map of 459 k entries
//! 13.5 ms (docs/hot-path.md, "maps that grow in shards").
//!
//! [`ShardedTable`] is extendible hashing over `hashbrown` tables: a directory indexed by
//! the low bits of a spread of the hash points at shards, several directory slots at one
//! shard while it is shallower than the directory. A shard grows like any `hashbrown`
//! table up to [`SHARD_BUCKETS`]; when it is full there, it splits into two shards by one
//! more hash bit (doubling the directory, a copy of 4-byte slots, if it was as deep as the
//! directory). One insert therefore moves at most one shard's entries, at most 448,
//! whatever the table's size. Memory stays that of one table: shards split at the load
//! where a table would double, into two half-full shards, and the directory and shard
//! list cost about 50 bytes per shard. Lookups in a sharded table pay two more loads
//! (directory slot, shard): about 13 ns per lookup in a table of 300 k entries whose
//! hasher read a node (measured before the block tables kept hash bits, see
//! `primary/worker.rs`), and more where the table is cold.
//!
//! So a table gets a directory only past [`SMALL_BUCKETS`]: until then it is one inline
//! `hashbrown` table, as cheap to reach as before, which this module doubles itself
//! (at most 1,792 entries moved), then deals once into shards (3,584 entries). At 2,048
//! workers every worker's block table stays that small; with the directory from the
//! first insert, their cold directories and shard lists cost 10–20 % of the ingest
//! rate. A move hashes each entry as it takes it out of the old table: the hashers of the
//! index's tables read nothing but the entry (the block tables keep the hash bits their
//! hasher needs beside each node id), so there are no cache misses to overlap and no
//! buffer of hashed entries to allocate.
//!
//! The directory bits come from the hash multiplied by an odd constant and shifted right
//! by 32, which uses neither the low bits (a shard's bucket index) nor the top seven bits
//! (`hashbrown`'s control tag) of the hash as they are, so the entries of one shard still
//! spread over its buckets and tags. Hashes that share many directory bits (a poor hash or
//! crafted keys) cannot split a shard forever: a shard grows as an ordinary table when the
//! directory would exceed [`MAX_DIR_PER_SHARD`] slots per shard.

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use rustc_hash::FxBuildHasher;

/// Buckets up to which a table has no directory (a power of two): a table this small
/// grows by doubling, moving at most 1,792 entries.
const SMALL_BUCKETS: usize = 4096;
/// Buckets of a shard at which it splits instead of growing (a power of two).
pub(crate) const SHARD_BUCKETS: usize = 512;
/// Entries a shard of [`SHARD_BUCKETS`] holds before it must grow: `hashbrown`'s 7/8.
const SHARD_CAPACITY: usize = SHARD_BUCKETS / 8 * 7;
/// Directory slots per shard beyond which the directory does not double: only hashes
/// that agree in many directory bits get there, and their shard grows as a plain table.
const MAX_DIR_PER_SHARD: usize = 8;

/// The 32 bits of `key` an entry that names its key through a node keeps (a block
/// table's `BlockEntry`, the child map's `BranchEntry`): the high half of a
/// multiplicative hash, which every bit of `key` but the top one reaches.
#[inline]
pub(crate) fn hash_bits(key: u64) -> u32 {
    (key.wrapping_mul(BITS_FACTOR) >> 32) as u32
}

/// An odd factor with bits spread over its whole width.
pub(crate) const BITS_FACTOR: u64 = 0xD6E8_FEB8_6659_FD93;

/// The table hash of an entry with [`hash_bits`] `bits`: the bits twice, so that
/// `hashbrown`'s bucket index (low bits) and its control tag (top seven bits) come from
/// different bits of them; the directory bits are a multiplicative spread of all.
#[inline]
pub(crate) fn table_hash(bits: u32) -> u64 {
    u64::from(bits) * 0x1_0000_0001
}

/// Directory bits of `hash`: the high half of a multiplicative spread.
#[inline]
fn spread(hash: u64) -> usize {
    (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize
}

#[derive(Debug, Clone)]
pub(crate) struct Shard<T> {
    table: HashTable<T>,
    /// Low directory bits every hash in this shard shares.
    depth: u32,
}

/// A `hashbrown::HashTable` look-alike that grows in shards (see the module docs). Like
/// `HashTable`, it stores values only; the caller passes each value's hash and equality.
#[derive(Debug, Clone)]
pub(crate) struct ShardedTable<T> {
    /// The whole table while it has no directory: up to [`SMALL_BUCKETS`], so a small
    /// table costs what a plain `HashTable` costs (no directory or shard to load).
    small: HashTable<T>,
    /// Shard index per directory slot; empty while the table is small, then a power of
    /// two long.
    dir: Vec<u32>,
    shards: Vec<Shard<T>>,
    len: usize,
}

impl<T> Default for ShardedTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ShardedTable<T> {
    pub(crate) const fn new() -> Self {
        ShardedTable {
            small: HashTable::new(),
            dir: Vec::new(),
            shards: Vec::new(),
            len: 0,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shard index `hash` belongs to (the table must have a directory).
    #[inline]
    fn shard_of(&self, hash: u64) -> usize {
        self.dir[spread(hash) & (self.dir.len() - 1)] as usize
    }

    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<&T> {
        if self.dir.is_empty() {
            return self.small.find(hash, eq);
        }
        self.shards[self.shard_of(hash)].table.find(hash, eq)
    }

    /// Removes and returns the value equal to `eq` under `hash`.
    #[inline]
    pub(crate) fn remove(&mut self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<T> {
        let table = if self.dir.is_empty() {
            &mut self.small
        } else {
            let s = self.shard_of(hash);
            &mut self.shards[s].table
        };
        let (value, _) = table.find_entry(hash, eq).ok()?.remove();
        self.len -= 1;
        Some(value)
    }

    /// Puts `value` in place of the value equal to `eq` under `hash` and returns that one,
    /// or inserts it: one probe unless the table must grow or a shard split first.
    /// `hasher` gives the hash of any value in the table (for a table or shard that grows).
    #[inline]
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        value: T,
        mut eq: impl FnMut(&T) -> bool,
        hasher: impl Fn(&T) -> u64,
    ) -> Option<T> {
        let table = if self.dir.is_empty() {
            &mut self.small
        } else {
            let s = self.shard_of(hash);
            &mut self.shards[s].table
        };
        if table.len() < table.capacity() {
            return match table.entry(hash, eq, &hasher) {
                Entry::Occupied(mut e) => Some(std::mem::replace(e.get_mut(), value)),
                Entry::Vacant(e) => {
                    e.insert(value);
                    self.len += 1;
                    None
                }
            };
        }
        if let Some(old) = table.find_mut(hash, &mut eq) {
            return Some(std::mem::replace(old, value));
        }
        self.insert_unique(hash, value, hasher);
        None
    }

    /// Inserts `value`, which must not be in the table yet. `hasher` gives the hash of any
    /// value in the table (for a table or shard that grows or splits).
    #[inline]
    pub(crate) fn insert_unique(&mut self, hash: u64, value: T, hasher: impl Fn(&T) -> u64) {
        if self.dir.is_empty() {
            if self.small.len() == self.small.capacity() {
                self.grow_small(&hasher);
            }
            if self.dir.is_empty() {
                self.small.insert_unique(hash, value, &hasher);
                self.len += 1;
                return;
            }
        }
        loop {
            let slot = spread(hash) & (self.dir.len() - 1);
            let s = self.dir[slot] as usize;
            let table = &self.shards[s].table;
            if table.len() < table.capacity() || !self.split(slot, &hasher) {
                self.shards[s].table.insert_unique(hash, value, &hasher);
                self.len += 1;
                return;
            }
        }
    }

    /// Makes room in the full small table: doubles it while it stays within
    /// [`SMALL_BUCKETS`], else deals its entries into shards of at most half a shard's
    /// capacity each, under a directory as deep as that takes.
    #[cold]
    fn grow_small(&mut self, hasher: &impl Fn(&T) -> u64) {
        let buckets = self.small.num_buckets();
        if buckets < 64 {
            // Tiny: `hashbrown`'s own growth moves a few dozen entries.
            self.small.reserve(1, hasher);
            return;
        }
        let moved = std::mem::take(&mut self.small);
        if buckets < SMALL_BUCKETS {
            self.small = HashTable::with_capacity(buckets * 2 / 8 * 7);
            for value in moved {
                self.small.insert_unique(hasher(&value), value, hasher);
            }
            return;
        }
        let mut depth = 0;
        while moved.len() >> depth > SHARD_CAPACITY / 2 {
            depth += 1;
        }
        self.dir = (0..1u32 << depth).collect();
        self.shards = (0..1usize << depth)
            .map(|_| Shard {
                table: HashTable::with_capacity(SHARD_CAPACITY),
                depth,
            })
            .collect();
        let mask = (1usize << depth) - 1;
        for value in moved {
            let hash = hasher(&value);
            self.shards[spread(hash) & mask]
                .table
                .insert_unique(hash, value, hasher);
        }
    }

    /// Splits the full shard at directory `slot` in two by one more directory bit, when it
    /// has reached [`SHARD_BUCKETS`] and holds more than half of that (with fewer entries,
    /// `hashbrown` reclaims its tombstones in place). Returns whether it split.
    #[cold]
    fn split(&mut self, slot: usize, hasher: &impl Fn(&T) -> u64) -> bool {
        let s = self.dir[slot] as usize;
        let Shard { table, depth } = &self.shards[s];
        let depth = *depth;
        if table.num_buckets() < SHARD_BUCKETS || table.len() <= SHARD_CAPACITY / 2 {
            return false;
        }
        if 1usize << depth == self.dir.len() {
            if self.dir.len() >= MAX_DIR_PER_SHARD * self.shards.len() || depth >= 32 {
                return false;
            }
            self.dir.extend_from_within(..);
        }
        let bit = 1usize << depth;
        let moved = std::mem::take(&mut self.shards[s].table);
        let mut low = HashTable::with_capacity(SHARD_CAPACITY);
        let mut high = HashTable::with_capacity(SHARD_CAPACITY);
        for value in moved {
            let hash = hasher(&value);
            let half = if spread(hash) & bit == 0 {
                &mut low
            } else {
                &mut high
            };
            half.insert_unique(hash, value, hasher);
        }
        // More than 4 billion shards is not a real case.
        let new = self.shards.len() as u32;
        self.shards[s] = Shard {
            table: low,
            depth: depth + 1,
        };
        self.shards.push(Shard {
            table: high,
            depth: depth + 1,
        });
        // The slots of shard `s` are those agreeing with `slot` in the low `depth` bits.
        for i in ((slot & (bit - 1))..self.dir.len()).step_by(bit) {
            if i & bit != 0 {
                self.dir[i] = new;
            }
        }
        true
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.small
            .iter()
            .chain(self.shards.iter().flat_map(|s| s.table.iter()))
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&mut T) -> bool) {
        self.small.retain(&mut keep);
        let mut len = self.small.len();
        for shard in &mut self.shards {
            shard.table.retain(&mut keep);
            len += shard.table.len();
        }
        self.len = len;
    }

    /// Removes everything and frees every shard.
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }

    /// Bytes allocated: the small table's or every shard's buckets and control bytes, the
    /// directory and the shard list.
    pub(crate) fn allocation_size(&self) -> usize {
        self.small.allocation_size()
            + self
                .shards
                .iter()
                .map(|s| s.table.allocation_size())
                .sum::<usize>()
            + self.dir.capacity() * std::mem::size_of::<u32>()
            + self.shards.capacity() * std::mem::size_of::<Shard<T>>()
    }

    /// Shards (for tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn shard_buckets(&self) -> impl Iterator<Item = usize> + '_ {
        self.shards.iter().map(|s| s.table.num_buckets())
    }
}

impl<T> IntoIterator for ShardedTable<T> {
    type Item = T;
    type IntoIter = std::iter::Chain<
        hashbrown::hash_table::IntoIter<T>,
        std::iter::FlatMap<
            std::vec::IntoIter<Shard<T>>,
            HashTable<T>,
            fn(Shard<T>) -> HashTable<T>,
        >,
    >;

    fn into_iter(self) -> Self::IntoIter {
        let shards: fn(Shard<T>) -> HashTable<T> = |s| s.table;
        self.small
            .into_iter()
            .chain(self.shards.into_iter().flat_map(shards))
    }
}

/// A map over a [`ShardedTable`] with the house `FxHash`: the subset of `FxHashMap`'s API
/// the index uses.
#[derive(Debug, Clone)]
pub(crate) struct ShardedMap<K, V> {
    table: ShardedTable<(K, V)>,
}

impl<K, V> Default for ShardedMap<K, V> {
    fn default() -> Self {
        ShardedMap {
            table: ShardedTable::new(),
        }
    }
}

#[inline]
fn fx_hash<K: Hash>(key: &K) -> u64 {
    FxBuildHasher.hash_one(key)
}

impl<K: Hash + Eq, V> ShardedMap<K, V> {
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    #[inline]
    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.table
            .find(fx_hash(key), |(k, _)| k == key)
            .map(|(_, v)| v)
    }

    #[cfg(test)]
    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Maps `key` to `value`; returns the value it replaced.
    #[inline]
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V>
    where
        K: Copy,
    {
        let hash = fx_hash(&key);
        let eq = move |(k, _): &(K, V)| *k == key;
        let old = self
            .table
            .insert(hash, (key, value), eq, |(k, _)| fx_hash(k));
        old.map(|(_, v)| v)
    }

    #[inline]
    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        self.table
            .remove(fx_hash(key), |(k, _)| k == key)
            .map(|(_, v)| v)
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.table.retain(|(k, v)| keep(k, v));
    }

    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        self.table.iter().map(|(k, v)| (k, v))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.table.iter().map(|(_, v)| v)
    }

    pub(crate) fn into_values(self) -> impl Iterator<Item = V> {
        self.table.into_iter().map(|(_, v)| v)
    }

    pub(crate) fn allocation_size(&self) -> usize {
        self.table.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::{SHARD_BUCKETS, ShardedMap, ShardedTable};

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Clear,
    }

    fn ops(keys: u64, max_len: usize) -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            8 => (0..keys, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            4 => (0..keys).prop_map(Op::Remove),
            1 => Just(Op::Clear),
        ];
        proptest::collection::vec(op, 0..max_len)
    }

    /// Runs `ops` on a table keyed through `hash` and on a `HashMap`, comparing every
    /// answer and the final contents.
    fn check(ops: &[Op], hash: fn(u64) -> u64) {
        let mut table: ShardedTable<(u64, u32)> = ShardedTable::new();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let by = |&(k, _): &(u64, u32)| hash(k);
        for op in ops {
            match *op {
                Op::Insert(k, v) => {
                    let old = table.insert(hash(k), (k, v), |e| e.0 == k, by);
                    assert_eq!(old.map(|e| e.1), model.insert(k, v));
                }
                Op::Remove(k) => {
                    let got = table.remove(hash(k), |e| e.0 == k).map(|e| e.1);
                    assert_eq!(got, model.remove(&k));
                }
                Op::Clear => {
                    table.clear();
                    model.clear();
                }
            }
            assert_eq!(table.len(), model.len());
        }
        for (&k, &v) in &model {
            assert_eq!(table.find(hash(k), |e| e.0 == k), Some(&(k, v)));
        }
        let mut all: Vec<(u64, u32)> = table.iter().copied().collect();
        all.sort_unstable();
        let mut expected: Vec<(u64, u32)> = model.into_iter().collect();
        expected.sort_unstable();
        assert_eq!(all, expected);
        let mut drained: Vec<(u64, u32)> = table.into_iter().collect();
        drained.sort_unstable();
        assert_eq!(drained, expected);
    }

    fn fx(k: u64) -> u64 {
        super::fx_hash(&k)
    }

    proptest! {
        #[test]
        fn small_table_equals_a_hash_map(ops in ops(3_000, 4_000)) {
            check(&ops, fx);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn sharded_table_equals_a_hash_map(ops in ops(12_000, 16_000)) {
            check(&ops, fx);
        }

        #[test]
        fn table_with_colliding_hashes_equals_a_hash_map(ops in ops(6_000, 12_000)) {
            // Keys below 1,000 share two hashes: no split can separate a shard of them, so
            // the directory stops doubling and that shard grows as a plain table.
            check(&ops, |k| if k < 1_000 { fx(k & 1) } else { fx(k) });
        }
    }

    #[test]
    fn a_small_table_has_no_directory() {
        let mut table: ShardedTable<u64> = ShardedTable::new();
        for k in 0..3_584u64 {
            table.insert_unique(fx(k), k, |&k| fx(k));
        }
        assert_eq!(table.shard_buckets().count(), 0);
        assert_eq!(table.small.num_buckets(), super::SMALL_BUCKETS);
        table.insert_unique(fx(3_584), 3_584, |&k| fx(k));
        assert_eq!(table.small.num_buckets(), 1, "dealt into shards");
        assert!(table.shard_buckets().all(|b| b == SHARD_BUCKETS));
        assert_eq!(table.iter().count(), 3_585);
    }

    #[test]
    fn a_large_table_never_holds_a_shard_past_the_split_size() {
        let mut table: ShardedTable<u64> = ShardedTable::new();
        for k in 0..300_000u64 {
            table.insert_unique(fx(k), k, |&k| fx(k));
        }
        assert_eq!(table.len(), 300_000);
        assert!(table.shard_buckets().all(|b| b <= SHARD_BUCKETS));
        // As much memory per entry as one table between two doublings: 8 bytes of value and
        // one control byte per bucket, at a load of 7/16 to 7/8.
        let per_entry = table.allocation_size() as f64 / 300_000.0;
        assert!(
            (9.0 * 8.0 / 7.0..=9.0 * 16.0 / 7.0 + 0.5).contains(&per_entry),
            "{per_entry}"
        );
        for k in (0..300_000u64).step_by(7) {
            assert_eq!(table.find(fx(k), |&v| v == k), Some(&k));
        }
    }

    #[test]
    fn map_replaces_removes_and_retains() {
        let mut map: ShardedMap<u64, u32> = ShardedMap::default();
        assert!(map.is_empty() && map.get(&1).is_none() && map.remove(&1).is_none());
        for k in 0..5_000 {
            assert_eq!(map.insert(k, k as u32), None);
        }
        assert_eq!(map.insert(7, 70), Some(7));
        assert_eq!(map.get(&7), Some(&70));
        assert!(map.contains_key(&4_999));
        assert_eq!(map.remove(&7), Some(70));
        assert!(!map.contains_key(&7));
        map.retain(|&k, v| {
            *v += 1;
            k % 2 == 0
        });
        assert_eq!(map.table.len(), 2_500);
        assert_eq!(map.get(&10), Some(&11));
        assert_eq!(map.iter().count(), 2_500);
        assert_eq!(map.values().map(|&v| u64::from(v)).sum::<u64>(), 6_250_000);
        assert_eq!(map.into_values().count(), 2_500);
    }
}
