//! The trie's containers, which note what each change touched while a log is on, so that a
//! mirror of the trie (`mirror.rs`) can copy just that.
//!
//! The node slab and the worker slots are vectors whose mutable indexing notes the index:
//! no write to either can bypass the log, because the containers give out no `&mut` to
//! their items in any other way. The child map notes each change in order, and the
//! own-hash maps of the worker states note through the [`OwnLog`] their writers pass in.

use std::ops::{Deref, Index, IndexMut};

use super::node::Node;
use crate::sharded::{ShardedTable, hash_bits, table_hash};

/// A vector whose changes note the index changed while the log is on.
///
/// Only items that were there when the log was turned on are noted: the ones added since
/// are all new to a mirror, which copies them whole (most of a store's nodes are new, and
/// noting each would cost every write for nothing).
#[derive(Debug)]
pub(super) struct Logged<T> {
    items: Vec<T>,
    /// Indexes below this are noted: the length when the log was turned on, 0 while it is
    /// off (one comparison per change is all an index without a mirror pays).
    noting: usize,
    /// The length when the log was last turned on.
    base: usize,
    /// Indexes below `base` changed since the log was turned on, in order, repeats
    /// included (but for a repeat of one of the last two noted, as a node and its parent
    /// changing in turn).
    touched: Vec<u32>,
}

impl<T> Logged<T> {
    pub(super) fn new(items: Vec<T>) -> Self {
        Logged {
            items,
            noting: 0,
            base: 0,
            touched: Vec::new(),
        }
    }

    #[inline]
    fn note(&mut self, i: usize) {
        if i < self.noting {
            let i = i as u32;
            if let [.., a, b] | [a @ b] = self.touched[..]
                && (a == i || b == i)
            {
                return;
            }
            self.touched.push(i);
        }
    }

    /// Appends `item`; returns its index.
    #[inline]
    pub(super) fn push(&mut self, item: T) -> u32 {
        self.items.push(item);
        // More than 4 billion nodes or slots is not reachable (200 GB of nodes).
        (self.items.len() - 1) as u32
    }

    /// `items[a]` to change and `items[b]` to read, `a != b`.
    #[inline]
    pub(super) fn pair_mut(&mut self, a: usize, b: usize) -> (&mut T, &T) {
        self.note(a);
        if a < b {
            let (x, y) = self.items.split_at_mut(b);
            (&mut x[a], &y[0])
        } else {
            let (x, y) = self.items.split_at_mut(a);
            (&mut y[0], &x[b])
        }
    }

    #[inline]
    pub(super) fn items(&self) -> &[T] {
        &self.items
    }

    pub(super) fn capacity(&self) -> usize {
        self.items.capacity()
    }

    /// Turns the log on, forgetting what it held.
    pub(super) fn log_on(&mut self) {
        self.base = self.items.len();
        self.noting = self.base;
        self.touched.clear();
    }

    pub(super) fn log_off(&mut self) {
        self.noting = 0;
    }

    /// Indexes below [`Logged::base`] changed while the log was on.
    pub(super) fn touched(&self) -> &[u32] {
        &self.touched
    }

    /// The length when the log was last turned on: later items are all new since.
    pub(super) fn base(&self) -> usize {
        self.base
    }

    /// Grows to `len` items with `fill`, or shrinks to it (a mirror matching its source).
    pub(super) fn resize_with(&mut self, len: usize, fill: impl FnMut() -> T) {
        self.items.resize_with(len, fill);
    }

    /// Appends `items` (a mirror taking its source's new nodes).
    pub(super) fn extend_from_slice(&mut self, items: &[T])
    where
        T: Clone,
    {
        self.items.extend_from_slice(items);
    }
}

impl<T> Deref for Logged<T> {
    type Target = [T];

    #[inline]
    fn deref(&self) -> &[T] {
        &self.items
    }
}

impl<T> Index<usize> for Logged<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.items[i]
    }
}

impl<T> IndexMut<usize> for Logged<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        self.note(i);
        &mut self.items[i]
    }
}

/// The trie's child map (children other than a node's inline first child), keyed by
/// (parent, local hash), whose changes are noted in order while the log is on.
///
/// An entry is the child's node id and 32 bits of its key's hash ([`BranchEntry`]); the
/// key itself is read from the child node (its `parent` and `local`, which never change
/// while it lives, and an entry lives no longer than its child). Eight bytes instead of a
/// key-and-value pair's 24: a fill of the index writes every branch twice (the index and
/// its mirror), and a smaller table is fewer cache misses and fresh pages per write. A
/// lookup reads the child node only where the 32 bits match, which for a hit is the node
/// the caller reads next anyway; an insert or a removal reads no node at all (an insert
/// adds a child its parent lacks, a removal names the child it takes out), so a mirror
/// replays the changes without its nodes being current.
#[derive(Debug, Default)]
pub(super) struct Branches {
    table: ShardedTable<BranchEntry>,
    on: bool,
    /// Each change, in order.
    changes: Vec<BranchChange>,
}

/// An entry of [`Branches`]: a child and [`hash_bits`] of its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BranchEntry {
    bits: u32,
    child: u32,
}

/// A change of [`Branches`], for a mirror to replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BranchChange {
    Added(BranchEntry),
    Removed(BranchEntry),
}

/// Spreads a parent's id over the whole word before it is mixed into a key's hash.
const PARENT_FACTOR: u64 = 0x9E37_79B9_7F4A_7C15;

/// The [`hash_bits`] of the key `(parent, local)`: the parent's id is spread over the
/// whole word first, so one block's tokens under many parents (a repeated block) hash
/// like distinct keys.
#[inline]
fn branch_bits(parent: u32, local: u64) -> u32 {
    hash_bits(local ^ u64::from(parent).wrapping_mul(PARENT_FACTOR))
}

impl BranchEntry {
    #[inline]
    fn new(parent: u32, local: u64, child: u32) -> Self {
        BranchEntry {
            bits: branch_bits(parent, local),
            child,
        }
    }
}

#[inline]
fn entry_hash(e: &BranchEntry) -> u64 {
    table_hash(e.bits)
}

impl Branches {
    /// The child of `parent` under `local`, read against `nodes` (the trie's).
    #[inline]
    pub(super) fn get(&self, nodes: &[Node], parent: u32, local: u64) -> Option<u32> {
        let bits = branch_bits(parent, local);
        self.table
            .find(table_hash(bits), |e| {
                e.bits == bits && {
                    let child = &nodes[e.child as usize];
                    child.local == local && child.parent == parent
                }
            })
            .map(|e| e.child)
    }

    /// Adds `child` under `(parent, local)`, which has no child there yet.
    #[inline]
    pub(super) fn insert(&mut self, parent: u32, local: u64, child: u32) {
        let entry = BranchEntry::new(parent, local, child);
        if self.on {
            self.changes.push(BranchChange::Added(entry));
        }
        self.put(entry);
    }

    /// Removes `child`, the child of `parent` under `local`.
    #[inline]
    pub(super) fn remove(&mut self, parent: u32, local: u64, child: u32) {
        let entry = BranchEntry::new(parent, local, child);
        if self.on {
            self.changes.push(BranchChange::Removed(entry));
        }
        self.take(entry);
    }

    #[inline]
    fn put(&mut self, entry: BranchEntry) {
        self.table
            .insert_unique(table_hash(entry.bits), entry, entry_hash);
    }

    #[inline]
    fn take(&mut self, entry: BranchEntry) {
        let removed = self
            .table
            .remove(table_hash(entry.bits), |e| e.child == entry.child);
        debug_assert_eq!(removed, Some(entry), "a branch removed twice");
    }

    /// Applies `changes`, another map's changes from where this one is equal to it (a
    /// mirror catching up with its source).
    pub(super) fn replay(&mut self, changes: &[BranchChange]) {
        for &change in changes {
            match change {
                BranchChange::Added(entry) => self.put(entry),
                BranchChange::Removed(entry) => self.take(entry),
            }
        }
    }

    pub(super) fn allocation_size(&self) -> usize {
        self.table.allocation_size()
    }

    pub(super) fn log_on(&mut self) {
        self.on = true;
        self.changes.clear();
    }

    pub(super) fn log_off(&mut self) {
        self.on = false;
    }

    /// Changes made while the log was on, in order.
    pub(super) fn changes(&self) -> &[BranchChange] {
        &self.changes
    }

    /// Makes the map equal to `src`'s (O(children): a mirror's first copy).
    pub(super) fn copy_all_from(&mut self, src: &Branches) {
        self.table.clone_from(&src.table);
    }
}

/// The `(slot, node)` pairs whose own-hash entry (`WorkerState::own_at`) changed while the
/// log was on. Worker states get it from their writer, which holds the trie's log.
#[derive(Debug, Default)]
pub(super) struct OwnLog {
    on: bool,
    changes: Vec<(u32, u32)>,
}

impl OwnLog {
    #[inline]
    pub(super) fn note(&mut self, slot: u32, node: u32) {
        if self.on {
            self.changes.push((slot, node));
        }
    }

    pub(super) fn log_on(&mut self) {
        self.on = true;
        self.changes.clear();
    }

    pub(super) fn log_off(&mut self) {
        self.on = false;
    }

    pub(super) fn is_on(&self) -> bool {
        self.on
    }

    pub(super) fn changes(&self) -> &[(u32, u32)] {
        &self.changes
    }
}

#[cfg(test)]
mod tests {
    use super::{BranchChange, Branches, Logged, PARENT_FACTOR, branch_bits};
    use crate::primary::node::{NONE, Node};
    use crate::primary::tests::colliding;

    #[test]
    fn only_changes_made_while_the_log_is_on_are_noted() {
        let mut v = Logged::new(vec![0u8; 4]);
        v[1] = 5;
        v.log_on();
        v[2] = 1;
        v[2] += 1;
        let _read = v[3];
        let (a, b) = v.pair_mut(0, 3);
        *a = *b;
        let new = v.push(9) as usize;
        v[new] = 8;
        v.log_off();
        v[1] = 7;
        // The pushed item is new since the log was turned on: copied whole, not noted.
        assert_eq!((v.touched(), v.base()), (&[2, 0][..], 4));
        assert_eq!(v.items(), &[0, 7, 2, 0, 8]);
        v.log_on();
        for i in [1, 2, 1, 2, 3, 1] {
            v[i] += 1;
        }
        assert_eq!(v.touched(), &[1, 2, 3, 1]);

        let nodes = [
            Node::new(NONE, 0, 0),
            Node::new(0, 1, 0),
            Node::new(0, 2, 0),
        ];
        let mut m = Branches::default();
        m.insert(0, 1, 1);
        m.log_on();
        m.insert(0, 2, 2);
        m.remove(0, 1, 1);
        m.log_off();
        let mut mirror = Branches::default();
        mirror.insert(0, 1, 1);
        mirror.replay(m.changes());
        m.remove(0, 2, 2);
        let [BranchChange::Added(added), BranchChange::Removed(removed)] = m.changes() else {
            panic!("{:?}", m.changes());
        };
        assert_eq!((added.child, removed.child), (2, 1));
        assert_eq!(mirror.get(&nodes, 0, 2), Some(2));
        assert_eq!(mirror.get(&nodes, 0, 1), None);
        assert_eq!(m.get(&nodes, 0, 2), None);
    }

    /// Keys whose 32 bits collide: every lookup is told apart by the child nodes, and
    /// removals take the child they name.
    #[test]
    fn branches_whose_bits_collide_are_told_apart_by_their_nodes() {
        let parent = 7u32;
        let spread = u64::from(parent).wrapping_mul(PARENT_FACTOR);
        // Locals whose keys with `parent` share their bits, then ordinary ones: enough
        // for the table to split into shards around the colliding one.
        let mut locals: Vec<u64> = colliding(0xb0a7, 1_200)
            .into_iter()
            .map(|k| k ^ spread)
            .collect();
        assert!(
            locals
                .iter()
                .all(|&l| branch_bits(parent, l) == branch_bits(parent, locals[0]))
        );
        locals.extend((1..10_000u64).map(|i| i.wrapping_mul(0xA076_1D64_78BD_642F)));
        let mut nodes: Vec<Node> = (0..=parent).map(|_| Node::new(NONE, 0, 0)).collect();
        let mut m = Branches::default();
        for &local in &locals {
            let child = nodes.len() as u32;
            nodes.push(Node::new(parent, local, 0));
            m.insert(parent, local, child);
        }
        let child_of = |i: usize| parent + 1 + i as u32;
        for (i, &local) in locals.iter().enumerate() {
            assert_eq!(m.get(&nodes, parent, local), Some(child_of(i)), "{i}");
            assert_eq!(m.get(&nodes, parent + 1, local), None, "{i}");
        }
        for (i, &local) in locals.iter().enumerate().step_by(3) {
            m.remove(parent, local, child_of(i));
        }
        for (i, &local) in locals.iter().enumerate() {
            let expected = (i % 3 != 0).then(|| child_of(i));
            assert_eq!(m.get(&nodes, parent, local), expected, "{i}");
        }
    }
}
