//! Simulated engines and the replay of one policy against an in-process service.
//!
//! Time is simulated (integer microseconds); only the service calls take wall time, which
//! is what the selection-latency and event-rate columns measure.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use kv_types::{ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey};
use rustc_hash::FxHashMap;
use service_builder::{
    CoreConfig, PartitionKey, PromptInput, SelectRequest, SelectionCore, WorkerRequest,
};

use super::policies::PolicySpec;
use super::trace::{Prepared, TraceRow, tokens_into};

/// The simulated engine's speed (the "simple documented model" of the issue).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TimingModel {
    /// Prefill throughput of one worker; prefills run one at a time per worker (FIFO).
    pub(crate) prefill_tokens_per_s: f64,
    /// Decode time per output token; decodes of one worker run concurrently (batched).
    pub(crate) decode_s_per_token: f64,
}

/// Settings shared by every policy of one replay.
#[derive(Clone, Debug)]
pub(crate) struct SimSettings {
    pub(crate) workers: usize,
    /// Per-worker KV capacity in engine blocks.
    pub(crate) capacity_blocks: usize,
    pub(crate) block_size: u32,
    pub(crate) seed: u64,
    pub(crate) timing: TimingModel,
    /// Arrival times are divided by this (2 = twice the trace's request rate).
    pub(crate) speedup: f64,
}

/// One worker's KV cache: blocks by chained hash with an LRU stamp.
///
/// Invariant: an ancestor block is always more recently used than its descendants (a touch
/// stamps a prompt's blocks from the last to the first), so eviction is leaf-first and a
/// resident block's whole prefix is resident, exactly what the index can match.
#[derive(Debug, Default)]
struct Cache {
    stamp_of: FxHashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    clock: u64,
}

impl Cache {
    /// Longest prefix of `blocks` resident here.
    fn prefix(&self, blocks: &[(kv_types::BlockHash, kv_types::SequenceHash)]) -> usize {
        blocks
            .iter()
            .take_while(|(_, s)| self.stamp_of.contains_key(&s.0))
            .count()
    }

    /// Makes `blocks` resident (most recently used), evicting LRU blocks first. Returns the
    /// evicted hashes; the caller emits the events.
    fn touch(&mut self, blocks: &[u64], capacity: usize, evicted: &mut Vec<ExternalHash>) {
        let missing = blocks
            .iter()
            .filter(|h| !self.stamp_of.contains_key(h))
            .count();
        // Refresh the resident ones first so they are never the victims.
        for &h in blocks.iter().rev() {
            if let Some(old) = self.stamp_of.get(&h).copied() {
                self.by_stamp.remove(&old);
                self.clock += 1;
                self.stamp_of.insert(h, self.clock);
                self.by_stamp.insert(self.clock, h);
            }
        }
        let over = (self.stamp_of.len() + missing).saturating_sub(capacity);
        for _ in 0..over {
            let Some((_, h)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&h);
            evicted.push(ExternalHash(h));
        }
        // Re-stamp everything in reverse so ancestors end up newest.
        for &h in blocks.iter().rev() {
            if let Some(old) = self.stamp_of.get(&h).copied() {
                self.by_stamp.remove(&old);
            }
            self.clock += 1;
            self.stamp_of.insert(h, self.clock);
            self.by_stamp.insert(self.clock, h);
        }
    }
}

#[derive(Debug)]
struct Worker {
    key: WorkerKey,
    cache: Cache,
    prefill_free_at_us: u64,
    event_id: u64,
}

/// What happened to one request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestOutcome {
    pub(crate) worker: usize,
    pub(crate) arrival_us: u64,
    pub(crate) isl: u32,
    pub(crate) osl: u32,
    pub(crate) cached_tokens: u64,
    /// Longest prefix any worker held at arrival, in tokens.
    pub(crate) best_tokens: u64,
    pub(crate) ttft_us: u64,
    pub(crate) select_wall: Duration,
}

/// Everything measured for one policy.
#[derive(Debug)]
pub(crate) struct PolicyRun {
    pub(crate) label: String,
    pub(crate) outcomes: Vec<RequestOutcome>,
    pub(crate) events: u64,
    pub(crate) event_blocks: u64,
    pub(crate) apply_wall: Duration,
    pub(crate) wall: Duration,
    /// Selections where the service's cached tokens differed from the simulator's (must be
    /// 0: the index mirrors the simulated caches exactly).
    pub(crate) index_mismatches: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Lifecycle {
    PrefillComplete,
    Free,
}

/// Replays `prepared` (with `rows` for the token ids) under one policy.
pub(crate) fn run_policy(
    spec: &PolicySpec,
    rows: &[TraceRow],
    prepared: &[Prepared],
    s: &SimSettings,
    progress: &indicatif::ProgressBar,
) -> Result<PolicyRun> {
    let config = CoreConfig {
        router: spec.router_config(),
        rng_seed: Some(s.seed),
        // Simulated time runs far ahead of the wall clock; nothing may expire on the latter.
        active_request_expiry: Duration::from_secs(24 * 3600),
        ..CoreConfig::default()
    };
    let core = SelectionCore::try_new_local(config, spec.factory())
        .map_err(|e| anyhow!("policy {}: cannot build the service: {e}", spec.label))?;
    let result = drive(&core, spec, rows, prepared, s, progress);
    // Stops the idle listeners' threads.
    core.shutdown();
    result
}

fn drive(
    core: &SelectionCore,
    spec: &PolicySpec,
    rows: &[TraceRow],
    prepared: &[Prepared],
    s: &SimSettings,
    progress: &indicatif::ProgressBar,
) -> Result<PolicyRun> {
    let partition = PartitionKey::default();
    let mut workers = Vec::with_capacity(s.workers);
    for i in 0..s.workers {
        let id = i as u64 + 1;
        let rec = core
            .upsert_worker(WorkerRequest {
                endpoint: Some(format!("http://sim-worker-{id}")),
                block_size: Some(s.block_size),
                kv_events_endpoint: Some(idle_endpoint()?),
                total_kv_blocks: Some(s.capacity_blocks as u64),
                ..WorkerRequest::new(id)
            })
            .map_err(|e| anyhow!("registering simulated worker {id}: {e}"))?;
        if !rec.is_schedulable() {
            bail!(
                "simulated worker {id} is not schedulable: {:?}",
                rec.not_schedulable_reasons
            );
        }
        workers.push(Worker {
            key: WorkerKey::new(id, 0),
            cache: Cache::default(),
            prefill_free_at_us: 0,
            event_id: 0,
        });
    }
    let index_of: FxHashMap<u64, usize> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| (w.key.worker_id.0, i))
        .collect();

    let block = u64::from(s.block_size);
    let mut due: BinaryHeap<Reverse<(u64, Lifecycle, usize)>> = BinaryHeap::new();
    let mut outcomes = Vec::with_capacity(prepared.len());
    let (mut events, mut event_blocks, mut mismatches) = (0u64, 0u64, 0u64);
    let mut apply_wall = Duration::ZERO;
    let mut tokens = Vec::new();
    let mut chain = Vec::new();
    let mut evicted = Vec::new();
    let started = Instant::now();

    for (i, (row, req)) in rows.iter().zip(prepared).enumerate() {
        let now = (req.arrival_us as f64 / s.speedup).round() as u64;
        while let Some(&Reverse((t, what, id))) = due.peek() {
            if t > now {
                break;
            }
            due.pop();
            lifecycle(core, what, id)?;
        }

        tokens_into(row, &mut tokens);
        let t0 = Instant::now();
        let resp = core
            .select_and_reserve(SelectRequest {
                partition: partition.clone(),
                selection_id: Some(id_of(i)),
                prompt: PromptInput {
                    token_ids: Some(tokens.clone()),
                    ..PromptInput::default()
                },
                expected_output_tokens: Some(req.osl),
                ..SelectRequest::default()
            })
            .map_err(|e| anyhow!("policy {}: request {i}: {e}", spec.label))?;
        let select_wall = t0.elapsed();
        let w = *index_of
            .get(&resp.worker_id)
            .with_context(|| format!("service chose unknown worker {}", resp.worker_id))?;

        let isl = u64::from(req.isl);
        let hit = workers[w].cache.prefix(&req.blocks);
        let best = workers
            .iter()
            .map(|x| x.cache.prefix(&req.blocks))
            .max()
            .unwrap_or(0);
        let cached_tokens = (hit as u64 * block).min(isl);
        if isl.saturating_sub(resp.effective_prefill_tokens) != cached_tokens {
            mismatches += 1;
        }

        // The engine stores the prompt's blocks (evicting LRU ones first) and says so.
        let worker = &mut workers[w];
        let stored = req.blocks.len().min(s.capacity_blocks);
        chain.clear();
        chain.extend(req.blocks[..stored].iter().map(|(_, sq)| sq.0));
        evicted.clear();
        worker.cache.touch(&chain, s.capacity_blocks, &mut evicted);
        let mut ops = Vec::with_capacity(2);
        if !evicted.is_empty() {
            worker.event_id += 1;
            event_blocks += evicted.len() as u64;
            ops.push(KvOperation {
                worker: worker.key,
                tier: StorageTier::Device,
                event_id: worker.event_id,
                kind: KvOperationKind::Removed {
                    block_hashes: std::mem::take(&mut evicted),
                },
            });
        }
        let first_new = hit.min(stored);
        if first_new < stored {
            worker.event_id += 1;
            event_blocks += (stored - first_new) as u64;
            ops.push(KvOperation {
                worker: worker.key,
                tier: StorageTier::Device,
                event_id: worker.event_id,
                kind: KvOperationKind::Stored {
                    parent_hash: first_new
                        .checked_sub(1)
                        .map(|p| ExternalHash(req.blocks[p].1.0)),
                    blocks: req.blocks[first_new..stored]
                        .iter()
                        .map(|(local, sq)| StoredBlock::new(ExternalHash(sq.0), *local))
                        .collect(),
                },
            });
        }
        if !ops.is_empty() {
            events += ops.len() as u64;
            let t1 = Instant::now();
            core.apply_events(&partition, &ops);
            apply_wall += t1.elapsed();
        }

        // Prefill queues FIFO behind the worker's earlier prefills; decode is batched.
        let prefill_us =
            ((isl - cached_tokens) as f64 / s.timing.prefill_tokens_per_s * 1e6).round() as u64;
        let start = now.max(worker.prefill_free_at_us);
        let prefill_done = start + prefill_us;
        worker.prefill_free_at_us = prefill_done;
        let free_at =
            prefill_done + (f64::from(req.osl) * s.timing.decode_s_per_token * 1e6).round() as u64;
        due.push(Reverse((prefill_done, Lifecycle::PrefillComplete, i)));
        due.push(Reverse((free_at, Lifecycle::Free, i)));

        outcomes.push(RequestOutcome {
            worker: w,
            arrival_us: now,
            isl: req.isl,
            osl: req.osl,
            cached_tokens,
            best_tokens: (best as u64 * block).min(isl),
            ttft_us: prefill_done - now,
            select_wall,
        });
        progress.inc(1);
    }
    while let Some(Reverse((_, what, id))) = due.pop() {
        lifecycle(core, what, id)?;
    }
    Ok(PolicyRun {
        label: spec.label.clone(),
        outcomes,
        events,
        event_blocks,
        apply_wall,
        wall: started.elapsed(),
        index_mismatches: mismatches,
    })
}

fn id_of(i: usize) -> String {
    format!("replay-{i}")
}

fn lifecycle(core: &SelectionCore, what: Lifecycle, i: usize) -> Result<()> {
    let id = id_of(i);
    match what {
        Lifecycle::PrefillComplete => core.prefill_complete(&id),
        Lifecycle::Free => core.free_reservation(&id),
    }
    .map_err(|e| anyhow!("{what:?} of {id}: {e}"))
}

/// A loopback endpoint nobody publishes on. With `use_kv_events` a worker is schedulable only
/// with an events endpoint; its listener connects and idles while the replay feeds the same
/// sink directly.
fn idle_endpoint() -> Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("picking a free loopback port")?;
    let port = l.local_addr().context("reading the free port")?.port();
    Ok(format!("tcp://127.0.0.1:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_leaves_first_and_keeps_prefixes_whole() {
        let mut c = Cache::default();
        let mut ev = Vec::new();
        c.touch(&[1, 2, 3], 4, &mut ev);
        c.touch(&[1, 5], 4, &mut ev);
        assert!(ev.is_empty());
        // Needs 2 slots: the oldest are the tail of the first prompt, 3 then 2.
        c.touch(&[6, 7], 4, &mut ev);
        assert_eq!(ev, [ExternalHash(3), ExternalHash(2)]);
        ev.clear();
        // 1 is an ancestor of 5 and was touched with it, so 5 goes before 1.
        c.touch(&[8], 4, &mut ev);
        assert_eq!(ev, [ExternalHash(5)]);
        assert!(c.stamp_of.contains_key(&1));
        assert_eq!(c.stamp_of.len(), 4);
    }
}
