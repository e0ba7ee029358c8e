//! Tiered query results and the per-worker summaries derived from them (§4.4–§4.6).

use std::ops::Range;

use kv_types::{DpRank, ExternalHash, WorkerId, WorkerKey};

use crate::primary::OverlapScores;

/// Blocks matched per tier by one worker key. `device` is the device score (after the
/// side-index merge); the others are the non-cumulative extensions found in that tier.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct TierHits {
    pub worker: WorkerKey,
    pub device: u32,
    pub host_pinned: u32,
    pub disk: u32,
    pub external: u32,
}

impl TierHits {
    /// `gpu(w)` of §4.5, in blocks.
    pub fn gpu(&self) -> u32 {
        self.device
    }

    /// `cpu(w) = gpu + host_pinned hits`, in blocks.
    pub fn cpu(&self) -> u32 {
        self.device.saturating_add(self.host_pinned)
    }

    /// `disk(w) = cpu + disk hits + external hits`, in blocks (cumulative).
    pub fn disk_cumulative(&self) -> u32 {
        self.cpu()
            .saturating_add(self.disk)
            .saturating_add(self.external)
    }

    /// Non-cumulative disk-class extension (`disk + external`) for §4.6.
    pub fn disk_extension(&self) -> u32 {
        self.disk.saturating_add(self.external)
    }

    /// `effective_overlap_blocks(w)` of §4.6.
    pub fn effective_overlap_blocks(&self, weights: TierWeights) -> f64 {
        let mut v = f64::from(self.device);
        if weights.host_cache_hit_weight != 0.0 {
            v += weights.host_cache_hit_weight * f64::from(self.host_pinned);
        }
        if weights.disk_cache_hit_weight != 0.0 {
            v += weights.disk_cache_hit_weight * f64::from(self.disk_extension());
        }
        v
    }

    /// `effective_cached_tokens(w)` of §4.6: rounded half away from zero, at least 0.
    pub fn effective_cached_tokens(&self, weights: TierWeights, block_size: u32) -> u64 {
        let v = (self.effective_overlap_blocks(weights) * f64::from(block_size)).round();
        if v.is_nan() || v <= 0.0 {
            0
        } else {
            // Saturating float-to-int conversion is the intended behavior for huge values.
            v as u64
        }
    }
}

/// Lower-tier weights of §4.6.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct TierWeights {
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights {
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
        }
    }
}

/// The `overlap` summary of one instance (worker id) over its ranks, in tokens (§4.5).
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct InstanceOverlap {
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
    pub longest_matched: u64,
    /// Every rank of the range, in order, with its gpu tokens (0 when unmatched).
    pub dp: Vec<(DpRank, u64)>,
}

/// Caller-owned answer buffer of a tiered query. Reused across queries.
#[derive(Clone, Debug, Default)]
pub struct TieredMatches {
    pub(crate) device: OverlapScores,
    pub(crate) hits: Vec<TierHits>,
    /// Per `hits` entry: walk position and anchor of its continuation.
    pub(crate) conts: Vec<(u32, Option<ExternalHash>)>,
    pub(crate) side: OverlapScores,
}

impl TieredMatches {
    pub fn new() -> Self {
        Self::default()
    }

    /// Device scores (primary merged with the side index when there is one).
    pub fn device(&self) -> &OverlapScores {
        &self.device
    }

    /// One entry per worker key with any hit on any tier, in no particular order.
    pub fn hits(&self) -> &[TierHits] {
        &self.hits
    }

    /// This index's internal worker slot of each of the first `hit_slots().len()` hits (the
    /// ones found on the device tier); later hits, and all hits when a side index merged
    /// in, have none. A slot is reused after its worker leaves the index, so it is a cache
    /// key to check against the hit's worker, never an identity.
    pub fn hit_slots(&self) -> &[u32] {
        self.device.slots()
    }

    pub fn get(&self, worker: WorkerKey) -> Option<&TierHits> {
        self.hits.iter().find(|h| h.worker == worker)
    }

    /// The §4.5 summary for `worker_id` over `ranks`, in tokens of `block_size`.
    pub fn instance_overlap(
        &self,
        worker_id: WorkerId,
        ranks: Range<u32>,
        block_size: u32,
    ) -> InstanceOverlap {
        let tokens = |blocks: u32| u64::from(blocks).saturating_mul(u64::from(block_size));
        let mut out = InstanceOverlap::default();
        for rank in ranks {
            let key = WorkerKey {
                worker_id,
                dp_rank: DpRank(rank),
            };
            let h = self.get(key).copied().unwrap_or_default();
            out.gpu = out.gpu.max(tokens(h.gpu()));
            out.cpu = out.cpu.max(tokens(h.cpu()));
            out.disk = out.disk.max(tokens(h.disk_cumulative()));
            out.dp.push((DpRank(rank), tokens(h.gpu())));
        }
        out.longest_matched = out.gpu.max(out.cpu).max(out.disk);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_summary_example() {
        // §4.5: rank 0 device 2, host 1, disk 2; rank 1 device 1, disk 1; block size 16.
        let m = TieredMatches {
            hits: vec![
                TierHits {
                    worker: WorkerKey::new(5, 0),
                    device: 2,
                    host_pinned: 1,
                    disk: 2,
                    external: 0,
                },
                TierHits {
                    worker: WorkerKey::new(5, 1),
                    device: 1,
                    host_pinned: 0,
                    disk: 1,
                    external: 0,
                },
            ],
            ..Default::default()
        };
        let s = m.instance_overlap(WorkerId(5), 0..3, 16);
        assert_eq!(
            s,
            InstanceOverlap {
                gpu: 32,
                cpu: 48,
                disk: 80,
                longest_matched: 80,
                dp: vec![(DpRank(0), 32), (DpRank(1), 16), (DpRank(2), 0)],
            }
        );
    }

    #[test]
    fn effective_tokens_weigh_extensions() {
        let h = TierHits {
            worker: WorkerKey::new(1, 0),
            device: 2,
            host_pinned: 1,
            disk: 1,
            external: 1,
        };
        let w = TierWeights::default();
        assert_eq!(h.effective_overlap_blocks(w), 2.0 + 0.75 + 0.5);
        assert_eq!(h.effective_cached_tokens(w, 16), 52);
        // 0.25 * 2 blocks of size 1 = 0.5 rounds away from zero.
        let d = TierHits {
            disk: 2,
            ..Default::default()
        };
        assert_eq!(d.effective_cached_tokens(w, 1), 1);
        let none = TierWeights {
            host_cache_hit_weight: 0.0,
            disk_cache_hit_weight: 0.0,
        };
        assert_eq!(h.effective_cached_tokens(none, 16), 32);
    }
}
