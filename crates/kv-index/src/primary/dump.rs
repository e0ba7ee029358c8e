//! The trie as `/dump` runs (§9.1), which a replay applies as stores to rebuild it.

use kv_types::{BlockHash, ExternalHash, StoredBlock, WorkerKey};

use super::node::{NONE, ROOT};
use super::trie::PrefixIndex;

impl PrefixIndex {
    /// Visits the tree as dump runs (§9.1): breadth-first, chains of nodes with identical
    /// owner sets merged into one run, one call per worker covering the run, parents first.
    /// Memberships a worker cannot reach from the root (after a mid-chain removal) are
    /// skipped: they never contribute to a match and would be rejected on replay anyway.
    /// Each worker's blocks and parent carry the hashes it stored them under, so a replay
    /// gives every worker back its own map.
    pub(crate) fn for_each_run(
        &self,
        mut emit: impl FnMut(WorkerKey, Option<ExternalHash>, &[StoredBlock]),
    ) {
        let n = self.nodes.len();
        // Children lists in CSR form, ordered by local hash for a deterministic dump.
        let mut pairs: Vec<(u32, u64, u32)> = Vec::with_capacity(self.live_nodes);
        for (id, node) in self.nodes.iter().enumerate().skip(1) {
            if node.parent != NONE {
                pairs.push((node.parent, node.local, id as u32));
            }
        }
        pairs.sort_unstable();
        let mut offsets = vec![0u32; n + 1];
        for &(p, _, _) in &pairs {
            offsets[p as usize + 1] += 1;
        }
        for i in 0..n {
            offsets[i + 1] += offsets[i];
        }
        let children = |id: u32| {
            let (a, b) = (offsets[id as usize], offsets[id as usize + 1]);
            pairs[a as usize..b as usize].iter().map(|&(_, _, c)| c)
        };

        // (run head, last node of the parent run, slots that reach the parent run).
        let mut queue: std::collections::VecDeque<(u32, Option<u32>, Vec<u32>)> =
            children(ROOT).map(|c| (c, None, Vec::new())).collect();
        let mut blocks: Vec<StoredBlock> = Vec::new();
        let mut run: Vec<u32> = Vec::new();
        let mut own: Vec<StoredBlock> = Vec::new();
        let mut keys: Vec<(WorkerKey, u32)> = Vec::new();
        let nodes = self.nodes.items();
        while let Some((head, parent, parent_reach)) = queue.pop_front() {
            let owners = self.nodes[head as usize].owners.as_slice();
            let reach: Vec<u32> = if parent.is_none() {
                owners.to_vec()
            } else {
                owners
                    .iter()
                    .copied()
                    .filter(|s| parent_reach.binary_search(s).is_ok())
                    .collect()
            };
            blocks.clear();
            run.clear();
            let mut cur = head;
            loop {
                let node = &self.nodes[cur as usize];
                run.push(cur);
                blocks.push(StoredBlock::new(
                    ExternalHash(node.external),
                    BlockHash(node.local),
                ));
                let mut kids = children(cur);
                match (kids.next(), kids.next()) {
                    (Some(only), None) if self.nodes[only as usize].owners.as_slice() == owners => {
                        cur = only;
                    }
                    _ => break,
                }
            }
            keys.clear();
            keys.extend(
                reach
                    .iter()
                    .filter_map(|&s| self.workers[s as usize].as_ref().map(|st| (st.key, s))),
            );
            keys.sort_unstable();
            for &(key, slot) in &keys {
                let Some(state) = self.workers[slot as usize].as_ref() else {
                    continue;
                };
                let parent_ext = parent.map(|p| state.external_of(nodes, p));
                if state.own_at.is_empty() {
                    emit(key, parent_ext, &blocks);
                } else {
                    own.clear();
                    own.extend(run.iter().zip(&blocks).map(|(&id, b)| {
                        StoredBlock::new(state.external_of(nodes, id), b.tokens_hash)
                    }));
                    emit(key, parent_ext, &own);
                }
            }
            if !reach.is_empty() {
                for c in children(cur) {
                    queue.push_back((c, Some(cur), reach.clone()));
                }
            }
        }
    }
}
