//! The floor `cargo xtask bench ingest` sets beside the null sink: the round's stream
//! applied to a partition as the server keeps it by default (the
//! index and its lookup mirror, every worker with its declared capacity, a writer thread
//! that applies the batches in turns of the server's length), with no sockets, no
//! decoding in the timing and no lookups: the calling thread only hands over decoded
//! batches.
//!
//! The server's index writer is one thread per partition, so the rate this reaches is the
//! most the server could apply in the same minutes whatever its listeners, sockets and
//! HTTP threads cost. On a virtual machine whose memory latency and price of a fresh page
//! move between minutes (docs/hot-path.md), it tells whether a round was held by the
//! index's own work on this host or by the rest of the server: the server's rate over this
//! floor compares across windows where the rate alone does not.
//!
//! Each floor runs in a child process of its own (`--index-floor-child`), as the server
//! does: a fresh process's heap faults every page in as the server's does, where memory
//! this process freed would come back from the allocator already resident, and the page
//! probe that follows would time the allocator instead of the machine.
//!
//! The batches are the publisher's own bytes (`Workload::batch`), decoded and normalized
//! once with the listeners' `Normalizer`, so the operations are exactly what the server's
//! writer applies, in the order a listener reads them from full queues: runs of a
//! worker's batches, a read burst long, worker after worker.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use kv_events::{Normalizer, READ_BURST};
use kv_index::{IndexCell, IndexCopies, IndexWriter, KvIndex};
use kv_types::{KvOperation, WorkerKey};

use crate::ingest_workload::Workload;

/// Block size every `bench ingest` worker registers with.
const BLOCK_SIZE: u32 = crate::ingest_workload::BLOCK_SIZE as u32;

/// The writer's step-aside interval: select-server's default (`--kv-writer-step-aside-us`),
/// which also sets how many batches a writer's turn applies before the mirror copies them.
const STEP_ASIDE: Duration = Duration::from_micros(250);

/// Runs the floor of `w` in a child process and returns the time its writes took.
pub(crate) fn measure(w: &Workload) -> Result<Duration> {
    let exe = std::env::current_exe().context("cannot locate the running xtask")?;
    let mut command = Command::new(exe);
    command
        .args(["bench", "ingest", "--index-floor-child"])
        .args(w.child_args());
    let out = command
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("failed to start the index floor process")?;
    if !out.status.success() {
        bail!("the index floor process failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let seconds: f64 = text
        .trim()
        .parse()
        .with_context(|| format!("the index floor process printed {text:?}"))?;
    Ok(Duration::from_secs_f64(seconds))
}

/// The child's side of [`measure`]: decodes, applies, and prints the seconds the writes took.
#[expect(
    clippy::print_stdout,
    reason = "the parent reads the figure from the child's output"
)]
pub(crate) fn child_main(w: &Workload) -> Result<()> {
    let took = Stream::decode(w)?.apply(w)?;
    println!("{}", took.as_secs_f64());
    Ok(())
}

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

    /// Applies the stream to a fresh default partition through its writer thread, as the
    /// server's listeners hand their batches over, and returns the time from the first
    /// hand-over to the last batch applied (the partition's creation, the prefixes and the
    /// drop not included). Then checks that it holds what the server must: every
    /// membership of the workload, and every node where nothing was evicted.
    pub(crate) fn apply(self, w: &Workload) -> Result<Duration> {
        let capacity = u32::try_from(w.declared_capacity()).unwrap_or(u32::MAX);
        let ids = w.workers;
        let cell = IndexCell::with_writer(
            IndexCopies::Two,
            IndexWriter::Thread,
            Some(STEP_ASIDE),
            move || {
                let mut index = KvIndex::with_block_size(BLOCK_SIZE);
                for id in 0..ids {
                    index.set_capacity(WorkerKey::new(id, 0), Some(capacity));
                }
                index
            },
        )
        .context("index floor: cannot start the writer thread")?;
        // The writer thread keeps the vectors it is handed.
        let mut batches = self.batches;
        let workers = w.workers as usize;
        let (prefixes, stream) = batches.split_at_mut(workers);
        // The prefix batches are not counted in the stream's blocks: applied before the
        // clock starts, as the server has them before its `go`.
        for batch in prefixes {
            cell.apply_batch_owned(batch);
        }
        cell.settle();
        // `stream` is seq-major (every worker's batch of one seq, then the next seq's).
        let seqs = stream.len() / workers.max(1);
        let started = Instant::now();
        for first in (0..seqs).step_by(READ_BURST) {
            for id in 0..workers {
                for seq in first..(first + READ_BURST).min(seqs) {
                    cell.apply_batch_owned(&mut stream[seq * workers + id]);
                }
            }
        }
        cell.settle();
        let took = started.elapsed();
        drop(batches);
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
