//! The floor `cargo xtask bench ingest` sets beside the null sink: the round's stream
//! applied in this (driver) process to a partition as the server keeps it by default (the
//! index and its lookup mirror, every worker with its declared capacity), on one thread,
//! with no sockets, no decoding in the timing, no lookups and no other thread of ours.
//!
//! The server's index writer is one thread per partition, so the rate this reaches is the
//! most the server could apply in the same minutes whatever its listeners, sockets and
//! HTTP threads cost. On a virtual machine whose memory latency and price of a fresh page
//! move between minutes (docs/hot-path.md), it tells whether a round was held by the
//! index's own work on this host or by the rest of the server: the server's rate over this
//! floor compares across windows where the rate alone does not.
//!
//! The batches are the publisher's own bytes (`Workload::batch`), decoded and normalized
//! once with the listeners' `Normalizer`, so the operations are exactly what the server's
//! writer applies; only their order differs (worker by worker within each batch round,
//! where the server takes them as they arrive).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use kv_events::Normalizer;
use kv_index::{IndexCell, IndexCopies, KvIndex};
use kv_types::{KvOperation, WorkerKey};

use crate::ingest_workload::Workload;

/// Block size every `bench ingest` worker registers with.
const BLOCK_SIZE: u32 = 16;

/// The stream of one run as the server's writer receives it: a batch per message.
pub(crate) struct Stream {
    batches: Vec<Vec<KvOperation>>,
}

impl Stream {
    /// Encodes every worker's batches (the prefixes, then the workload) as the publisher
    /// does and decodes them as the listeners do. Fails on any batch the decoder rejects or
    /// any event it filters: the floor must apply what the server applies.
    pub(crate) fn decode(w: &Workload) -> Result<Self> {
        let mut normalizers: Vec<Normalizer> = (0..w.workers)
            .map(|id| Normalizer::new(WorkerKey::new(id, 0), BLOCK_SIZE))
            .collect();
        let mut batches = Vec::with_capacity((w.workers * w.batches_per_worker()) as usize);
        let mut filtered = 0u64;
        // Seq 1 is the prefixes; the workload's batches follow (seq 0 is the probe).
        for seq in 1..=w.batches_per_worker() {
            for (id, normalizer) in normalizers.iter_mut().enumerate() {
                let payload = w.batch(id as u64, seq)?;
                let mut ops = Vec::with_capacity(w.events as usize * 2);
                normalizer
                    .process_payload(&payload, seq, &mut ops, |_| filtered += 1)
                    .with_context(|| format!("index floor: worker {id}, seq {seq}"))?;
                batches.push(ops);
            }
        }
        ensure!(
            filtered == 0,
            "index floor: the normalizer filtered {filtered} events of the workload"
        );
        Ok(Stream { batches })
    }

    /// Applies the stream to a fresh default partition and returns the time the writes
    /// took (the partition's creation and drop not included), after checking that it holds
    /// what the server must: every node and membership of the workload, its evictions.
    pub(crate) fn apply(&self, w: &Workload) -> Result<Duration> {
        let capacity = u32::try_from(w.declared_capacity()).unwrap_or(u32::MAX);
        let workers = w.workers;
        let cell = IndexCell::new(IndexCopies::Two, None, move || {
            let mut index = KvIndex::with_block_size(BLOCK_SIZE);
            for id in 0..workers {
                index.set_capacity(WorkerKey::new(id, 0), Some(capacity));
            }
            index
        });
        // The prefix batches are the same in every run and not counted in the stream's
        // blocks: applied before the clock starts, as the server has them before its `go`.
        let (prefixes, stream) = self.batches.split_at(w.workers as usize);
        for batch in prefixes {
            cell.apply_batch(batch);
        }
        let started = Instant::now();
        for batch in stream {
            cell.apply_batch(batch);
        }
        let took = started.elapsed();
        let stats = cell.read_whole().primary_stats();
        let expected_nodes = if w.evictions() == 0 {
            Some(w.nodes())
        } else {
            // Evictions free nodes only where no other worker holds them: the count
            // depends on which blocks go, so only the memberships are exact.
            None
        };
        ensure!(
            stats.memberships as u64 == w.memberships()
                && expected_nodes.is_none_or(|n| stats.nodes as u64 == n),
            "index floor: the partition holds {} nodes and {} memberships, expected {} and {}",
            stats.nodes,
            stats.memberships,
            expected_nodes.map_or_else(|| "any".to_owned(), |n| n.to_string()),
            w.memberships()
        );
        drop(cell);
        Ok(took)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(capacity: Option<u64>, retain: Option<u64>) -> Workload {
        Workload {
            workers: 3,
            batches: 4,
            events: 5,
            blocks: 4,
            shared: 1.0 / 3.0,
            capacity,
            retain,
        }
    }

    #[test]
    fn the_floor_applies_every_block_of_the_stream() {
        for w in [
            small(None, None),
            small(Some(40), None),
            small(None, Some(6)),
            small(Some(20), Some(9)),
        ] {
            let stream = Stream::decode(&w).unwrap();
            assert_eq!(
                stream.batches.len() as u64,
                w.workers * w.batches_per_worker()
            );
            stream.apply(&w).unwrap();
        }
    }

    #[test]
    fn a_partition_missing_a_batch_fails_the_check() {
        let w = small(None, None);
        let mut stream = Stream::decode(&w).unwrap();
        stream.batches.pop();
        let err = stream.apply(&w).unwrap_err().to_string();
        assert!(err.contains("memberships"), "{err}");
    }
}
