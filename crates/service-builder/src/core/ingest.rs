//! KV operations from the listeners (and the replay tool) into the partition indexes.

use kv_types::KvOperation;

use super::SelectionCore;
use crate::catalog::PartitionKey;
use crate::ingress::IngressSink;

impl IngressSink for std::sync::Weak<SelectionCore> {
    fn apply(&self, partition: &PartitionKey, ops: &[KvOperation]) {
        if let Some(core) = self.upgrade() {
            core.apply_events(partition, ops);
        }
    }
}

impl SelectionCore {
    /// Applies normalized engine events to a partition's index: the same path the ZMQ
    /// listeners feed (for embedding hosts that receive events by other means, and replay).
    pub fn apply_events(&self, partition: &PartitionKey, ops: &[KvOperation]) {
        let Some(p) = self.partition(partition) else {
            return;
        };
        for op in ops {
            // Short write sections, unlocked fairly: a lookup waits behind at most one piece
            // of one event, never behind a whole batch or a writer that re-locks at once.
            kv_index::apply_fairly(&p.index, op);
        }
    }
}
