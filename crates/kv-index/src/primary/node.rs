//! The slab entry of the trie, its reserved ids and the first-child bits that let a walk
//! along a chain of one owner set skip reading owner sets.

use crate::owners::Owners;

/// Node id of the root (the empty prefix). Never pruned.
pub(super) const ROOT: u32 = 0;
/// "No node" marker for `first_child` and for free slab entries' `parent`.
pub(super) const NONE: u32 = u32::MAX;
/// `Node::kids` bit: the first child's owner set equals this node's.
pub(super) const FC_SAME: u32 = 1 << 31;
/// `Node::kids` bits holding the child count.
pub(super) const KIDS: u32 = !FC_SAME;

/// One block position of the trie: a prefix of local hashes.
///
/// 48 bytes. The first child is kept inline because most nodes of a real tree are links of
/// a chain: walking a chain then touches only the slab (nodes of one store are allocated
/// next to each other), and only real branch points pay for a hash-map probe.
#[derive(Clone, Debug)]
pub(super) struct Node {
    pub(super) local: u64,
    /// Set by the store that created the node (first writer wins).
    pub(super) external: u64,
    pub(super) parent: u32,
    pub(super) first_child: u32,
    /// Child count, plus [`FC_SAME`]: set only while the first child's owner set equals
    /// this node's, so a lookup walking a chain of one owner set never reads owner sets
    /// (for a shared prefix, a 128-slot heap vector per block).
    pub(super) kids: u32,
    /// Number of per-worker map entries pointing here. A node is only freed when nothing
    /// can reach it any more, so a stale map entry can never alias a reused id.
    pub(super) refs: u32,
    pub(super) owners: Owners,
}

impl Node {
    /// The tag of the block this node holds in a capacity's gain order
    /// (`crate::capacity::Entry`): the low half of its engine hash, which a freed node
    /// taken by another block changes.
    #[inline]
    pub(super) fn tag(&self) -> u32 {
        self.external as u32
    }

    /// Makes this node equal to `src` without allocating where it can
    /// ([`Owners::copy_from`]).
    #[inline]
    pub(super) fn copy_from(&mut self, src: &Node) {
        self.local = src.local;
        self.external = src.external;
        self.parent = src.parent;
        self.first_child = src.first_child;
        self.kids = src.kids;
        self.refs = src.refs;
        self.owners.copy_from(&src.owners);
    }

    pub(super) fn new(parent: u32, local: u64, external: u64) -> Self {
        Node {
            local,
            external,
            parent,
            first_child: NONE,
            kids: 0,
            refs: 0,
            owners: Owners::default(),
        }
    }
}

/// Bits cleared by the current apply call's one-slot owner changes, each restorable when
/// the other side of its pair gets the same change (see `PrefixIndex::owners_changed`).
/// Reset at the start of every apply call and whenever a node is freed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Memo {
    /// `(node, first child)`: `node` changed while equal to its first child.
    pub(super) own: (u32, u32),
    /// `(parent, node)`: the first child `node` changed while equal to `parent`.
    pub(super) up: (u32, u32),
}

impl Default for Memo {
    fn default() -> Self {
        Memo {
            own: (NONE, NONE),
            up: (NONE, NONE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Node;

    #[test]
    fn node_is_48_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 48);
    }
}
