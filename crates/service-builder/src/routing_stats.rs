//! Routing-loss accounting per partition: for every booking that a selection chose, the
//! prompt tokens, the tokens the chosen rank held on device, and the most any candidate
//! held. `cached / prompt` is the hit ratio an operator gets; `(best − cached) / prompt` is
//! what the policy left on the table (load balance, affinity or a worse policy).
//!
//! Relaxed atomics only: a booking adds three numbers the selection already computed and
//! bumps one bucket, and the scrape reads them without a lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds of the `chosen / best` ratio buckets (the last bucket is `+Inf`, which only
/// `1.0` reaches since the ratio never exceeds 1).
pub const ROUTING_RATIO_BUCKETS: [f64; 6] = [0.0, 0.25, 0.5, 0.75, 0.9, 0.999];

/// The device-overlap figures of one routed booking, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RoutingSample {
    pub(crate) prompt_tokens: u64,
    /// Device tokens the chosen rank held (at most `prompt_tokens`).
    pub(crate) cached_tokens: u64,
    /// Device tokens the best eligible candidate held (at least `cached_tokens`).
    pub(crate) best_cached_tokens: u64,
}

impl RoutingSample {
    /// From device blocks: each is capped at the prompt (its tail block may be partial).
    pub(crate) fn from_blocks(isl: u64, chosen: u32, best: u32, block_size: u32) -> Self {
        let tokens = |b: u32| (u64::from(b) * u64::from(block_size)).min(isl);
        let cached_tokens = tokens(chosen);
        Self {
            prompt_tokens: isl,
            cached_tokens,
            best_cached_tokens: tokens(best).max(cached_tokens),
        }
    }
}

/// The counters of one partition.
#[derive(Debug, Default)]
pub(crate) struct RoutingStats {
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    best_cached_tokens: AtomicU64,
    /// Bookings by `chosen / best` bucket; bookings where no candidate held anything are
    /// not observed (the ratio is undefined and no routing could have done better).
    ratio: [AtomicU64; ROUTING_RATIO_BUCKETS.len() + 1],
    ratio_sum_micros: AtomicU64,
}

/// A snapshot for the scrape.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct RoutingSnapshot {
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) best_cached_tokens: u64,
    /// Per bucket (not cumulative).
    pub(crate) ratio: [u64; ROUTING_RATIO_BUCKETS.len() + 1],
    /// Sum of the observed ratios.
    pub(crate) ratio_sum: f64,
}

/// The ratio sum is kept in millionths so that it is one integer add.
const RATIO_SCALE: f64 = 1e6;

impl RoutingStats {
    pub(crate) fn record(&self, s: RoutingSample) {
        self.prompt_tokens
            .fetch_add(s.prompt_tokens, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(s.cached_tokens, Ordering::Relaxed);
        self.best_cached_tokens
            .fetch_add(s.best_cached_tokens, Ordering::Relaxed);
        if s.best_cached_tokens > 0 {
            let r = s.cached_tokens as f64 / s.best_cached_tokens as f64;
            let i = ROUTING_RATIO_BUCKETS.partition_point(|&b| b < r);
            self.ratio[i].fetch_add(1, Ordering::Relaxed);
            self.ratio_sum_micros
                .fetch_add((r * RATIO_SCALE).round() as u64, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> RoutingSnapshot {
        RoutingSnapshot {
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            cached_tokens: self.cached_tokens.load(Ordering::Relaxed),
            best_cached_tokens: self.best_cached_tokens.load(Ordering::Relaxed),
            ratio: std::array::from_fn(|i| self.ratio[i].load(Ordering::Relaxed)),
            ratio_sum: self.ratio_sum_micros.load(Ordering::Relaxed) as f64 / RATIO_SCALE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_cap_at_the_prompt_and_best_is_never_below_chosen() {
        let s = RoutingSample::from_blocks(100, 7, 9, 16);
        assert_eq!(
            (s.prompt_tokens, s.cached_tokens, s.best_cached_tokens),
            (100, 100, 100)
        );
        let s = RoutingSample::from_blocks(1000, 3, 1, 16);
        assert_eq!((s.cached_tokens, s.best_cached_tokens), (48, 48));
    }

    #[test]
    fn ratios_land_in_their_buckets() {
        let st = RoutingStats::default();
        st.record(RoutingSample::from_blocks(1000, 0, 4, 16)); // 0 -> bucket 0
        st.record(RoutingSample::from_blocks(1000, 2, 4, 16)); // 0.5 -> bucket 2
        st.record(RoutingSample::from_blocks(1000, 4, 4, 16)); // 1 -> +Inf
        st.record(RoutingSample::from_blocks(1000, 0, 0, 16)); // not observed
        let s = st.snapshot();
        assert_eq!(s.ratio, [1, 0, 1, 0, 0, 0, 1]);
        assert_eq!(s.prompt_tokens, 4000);
        assert_eq!(s.cached_tokens, 32 + 64);
        assert_eq!(s.best_cached_tokens, 64 * 3);
        assert!((s.ratio_sum - 1.5).abs() < 1e-9);
    }
}
