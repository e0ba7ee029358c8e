//! A compact sorted set of worker slots: the owner list of one trie node.
//!
//! Most nodes of a real tree are held by one to three workers, so those live inline in
//! 16 bytes; only shared prefixes (the system prompt held by every worker) pay for a heap
//! vector, and they are few.

/// Sorted, duplicate-free set of worker slot ids.
///
/// Representation invariants: `Heap` holds at least [`INLINE`] slots (a set grows to the
/// heap past [`INLINE`] and returns inline below it, so a node whose owner count swings
/// between three and four does not allocate and free at every swing), and the unused
/// lanes of `Inline` are 0, so [`Owners::same`] compares two inline sets as plain arrays
/// (a mixed pair is compared as slices).
#[derive(Clone, Debug)]
pub(crate) enum Owners {
    Inline {
        len: u8,
        ids: [u32; INLINE],
    },
    #[expect(
        clippy::box_collection,
        reason = "keeps the enum at 16 bytes; the extra allocation is paid only by shared nodes"
    )]
    Heap(Box<Vec<u32>>),
}

const INLINE: usize = 3;

impl Default for Owners {
    fn default() -> Self {
        Owners::Inline {
            len: 0,
            ids: [0; INLINE],
        }
    }
}

impl Owners {
    #[inline]
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Owners::Inline { len, ids } => &ids[..usize::from(*len)],
            Owners::Heap(v) => v.as_slice(),
        }
    }

    /// Set equality, without a `memcmp` call for the (common) inline sets.
    #[inline]
    pub(crate) fn same(&self, other: &Owners) -> bool {
        match (self, other) {
            (Owners::Inline { len: a, ids: x }, Owners::Inline { len: b, ids: y }) => {
                a == b && x == y
            }
            _ => self.as_slice() == other.as_slice(),
        }
    }

    /// Makes this set equal to `src`, reusing this set's heap vector when both are on the
    /// heap (a mirror copies a shared prefix's owner set at every change of it).
    #[inline]
    pub(crate) fn copy_from(&mut self, src: &Owners) {
        match (&mut *self, src) {
            (Owners::Heap(mine), Owners::Heap(theirs)) => mine.clone_from(theirs),
            _ => *self = src.clone(),
        }
    }

    /// Heap bytes owned by this set (0 when inline).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Owners::Inline { .. } => 0,
            Owners::Heap(v) => {
                std::mem::size_of::<Vec<u32>>() + v.capacity() * std::mem::size_of::<u32>()
            }
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.as_slice().len()
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub(crate) fn contains(&self, slot: u32) -> bool {
        self.as_slice().binary_search(&slot).is_ok()
    }

    /// Inserts `slot`; returns whether it was new.
    #[inline]
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        if let Owners::Inline { len, ids } = self {
            let n = usize::from(*len);
            if n < INLINE {
                // At most two compares: cheaper than a generic binary search, and the
                // single-owner node (most of a real tree) is the common case.
                let mut pos = n;
                for (i, &id) in ids[..n].iter().enumerate() {
                    if id >= slot {
                        if id == slot {
                            return false;
                        }
                        pos = i;
                        break;
                    }
                }
                // Element moves, not `copy_within`: that is a `memmove` call even for
                // zero or one lane.
                for i in (pos..n).rev() {
                    ids[i + 1] = ids[i];
                }
                ids[pos] = slot;
                *len += 1;
                return true;
            }
        }
        self.insert_slow(slot)
    }

    /// [`Owners::insert`] into a full inline set or a heap set.
    fn insert_slow(&mut self, slot: u32) -> bool {
        let pos = match self.as_slice().binary_search(&slot) {
            Ok(_) => return false,
            Err(pos) => pos,
        };
        match self {
            Owners::Inline { len, ids } => {
                let n = usize::from(*len);
                if n < INLINE {
                    ids.copy_within(pos..n, pos + 1);
                    ids[pos] = slot;
                    *len += 1;
                } else {
                    let mut v = Vec::with_capacity(INLINE * 2);
                    v.extend_from_slice(&ids[..n]);
                    v.insert(pos, slot);
                    *self = Owners::Heap(Box::new(v));
                }
            }
            Owners::Heap(v) => v.insert(pos, slot),
        }
        true
    }

    /// Removes `slot`; returns whether it was present.
    #[inline]
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        if let Owners::Inline { len, ids } = self {
            let n = usize::from(*len);
            let Some(pos) = ids[..n].iter().position(|&id| id == slot) else {
                return false;
            };
            for i in pos..n - 1 {
                ids[i] = ids[i + 1];
            }
            ids[n - 1] = 0;
            *len -= 1;
            return true;
        }
        self.remove_slow(slot)
    }

    /// [`Owners::remove`] from a heap set.
    fn remove_slow(&mut self, slot: u32) -> bool {
        let Ok(pos) = self.as_slice().binary_search(&slot) else {
            return false;
        };
        match self {
            Owners::Inline { len, ids } => {
                let n = usize::from(*len);
                ids.copy_within(pos + 1..n, pos);
                ids[n - 1] = 0;
                *len -= 1;
            }
            Owners::Heap(v) => {
                v.remove(pos);
                if v.len() < INLINE {
                    let mut ids = [0; INLINE];
                    ids[..v.len()].copy_from_slice(v);
                    // len <= INLINE = 3 always fits a u8.
                    let len = v.len() as u8;
                    *self = Owners::Inline { len, ids };
                }
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn owners_is_sixteen_bytes() {
        assert_eq!(std::mem::size_of::<Owners>(), 16);
    }

    #[test]
    fn insert_remove_matches_a_btreeset() {
        let mut o = Owners::default();
        let mut m = BTreeSet::new();
        let mut x = 7u32;
        for i in 0..2000 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let slot = (x >> 16) % 9;
            if i % 3 == 0 {
                assert_eq!(o.remove(slot), m.remove(&slot));
            } else {
                assert_eq!(o.insert(slot), m.insert(slot));
            }
            assert_eq!(
                o.as_slice(),
                m.iter().copied().collect::<Vec<_>>().as_slice()
            );
            assert_eq!(o.contains(3), m.contains(&3));
            if let Owners::Inline { len, ids } = &o {
                assert!(ids[usize::from(*len)..].iter().all(|&x| x == 0));
            }
            match &o {
                Owners::Heap(_) => assert!(o.len() >= INLINE),
                Owners::Inline { .. } => assert!(o.len() <= INLINE),
            }
            let copy = o.clone();
            assert!(o.same(&copy));
            let mut other = o.clone();
            if other.insert(100) {
                assert!(!o.same(&other));
            }
        }
    }
}
