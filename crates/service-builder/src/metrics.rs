//! The service's counters and latency histogram: plain atomics, updated on the hot path
//! without locks and read by the app's `/metrics` exporter at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (µs) of the selection-latency buckets; the last bucket is `+Inf`.
pub const SELECTION_LATENCY_BUCKETS_US: [u64; 10] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 100_000, 1_000_000,
];

/// A fixed-bucket histogram (Prometheus semantics: cumulative on export).
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; SELECTION_LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    pub fn observe(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = SELECTION_LATENCY_BUCKETS_US.partition_point(|&b| b < us);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// `(upper bound in µs or None for +Inf, cumulative count)` rows, then the sum in µs.
    pub fn snapshot(&self) -> (Vec<(Option<u64>, u64)>, u64) {
        let mut acc = 0;
        let rows = self
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                acc += b.load(Ordering::Relaxed);
                (SELECTION_LATENCY_BUCKETS_US.get(i).copied(), acc)
            })
            .collect();
        (rows, self.sum_us.load(Ordering::Relaxed))
    }
}

/// Counters and totals exported on `/metrics`.
#[derive(Debug, Default)]
pub struct CoreMetrics {
    pub selections: AtomicU64,
    pub bookings: AtomicU64,
    pub selection_errors: AtomicU64,
    pub pending_evictions: AtomicU64,
    pub expired_reservations: AtomicU64,
    pub reservations_rejected_full: AtomicU64,
    pub frees: AtomicU64,
    /// Wall time of `select` / `select_and_reserve` inside the core (queue wait included).
    pub selection_latency: LatencyHistogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        let h = LatencyHistogram::default();
        for us in [10, 25, 26, 2_000_000] {
            h.observe(Duration::from_micros(us));
        }
        let (rows, sum) = h.snapshot();
        assert_eq!(rows[0], (Some(25), 2));
        assert_eq!(rows[1], (Some(50), 3));
        assert_eq!(rows.last(), Some(&(None, 4)));
        assert_eq!(sum, 10 + 25 + 26 + 2_000_000);
    }
}
