//! The trie's containers, which note what each change touched while a log is on, so that a
//! mirror of the trie (`mirror.rs`) can copy just that.
//!
//! The node slab and the worker slots are vectors whose mutable indexing notes the index:
//! no write to either can bypass the log, because the containers give out no `&mut` to
//! their items in any other way. The child map notes each change in order, and the
//! own-hash maps of the worker states note through the [`OwnLog`] their writers pass in.

use std::ops::{Deref, Index, IndexMut};

use crate::sharded::ShardedMap;

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
#[derive(Debug, Default)]
pub(super) struct Branches {
    map: ShardedMap<(u32, u64), u32>,
    on: bool,
    /// `(key, child)` per change; a removal notes `NONE` as the child.
    changes: Vec<((u32, u64), u32)>,
}

impl Branches {
    #[inline]
    pub(super) fn get(&self, key: &(u32, u64)) -> Option<&u32> {
        self.map.get(key)
    }

    #[inline]
    pub(super) fn insert(&mut self, key: (u32, u64), child: u32) {
        if self.on {
            self.changes.push((key, child));
        }
        self.map.insert(key, child);
    }

    #[inline]
    pub(super) fn remove(&mut self, key: &(u32, u64)) {
        if self.on {
            self.changes.push((*key, super::node::NONE));
        }
        self.map.remove(key);
    }

    pub(super) fn allocation_size(&self) -> usize {
        self.map.allocation_size()
    }

    pub(super) fn log_on(&mut self) {
        self.on = true;
        self.changes.clear();
    }

    pub(super) fn log_off(&mut self) {
        self.on = false;
    }

    /// Changes made while the log was on, in order.
    pub(super) fn changes(&self) -> &[((u32, u64), u32)] {
        &self.changes
    }

    /// Makes the map equal to `src`'s (O(children): a mirror's first copy).
    pub(super) fn copy_all_from(&mut self, src: &Branches) {
        self.map.clone_from(&src.map);
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
    use super::{Branches, Logged};

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

        let mut m = Branches::default();
        m.insert((0, 1), 1);
        m.log_on();
        m.insert((0, 2), 2);
        m.remove(&(0, 1));
        m.log_off();
        m.remove(&(0, 2));
        assert_eq!(m.changes(), &[((0, 2), 2), ((0, 1), u32::MAX)]);
    }
}
