//! Busy predicates against thresholds and capacities (`scheduling.md` §4.6, §5.1).

/// Prefill capacity assumed for a worker that did not register `max_num_batched_tokens`.
pub const DEFAULT_PREFILL_TOKEN_CAPACITY: u64 = 10_000_000;

/// Prefill busy thresholds of a policy class (or the conditional-disaggregation threshold).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefillBusyThreshold {
    /// Absolute active prefill tokens.
    pub tokens: Option<u64>,
    /// Fraction of the worker's prefill token capacity.
    pub fraction: Option<f64>,
}

impl PrefillBusyThreshold {
    /// Whether any threshold is set (queueing is enabled for a class iff so).
    pub fn is_set(&self) -> bool {
        self.tokens.is_some() || self.fraction.is_some()
    }

    /// `active > tokens` or `active > fraction · capacity` (capacity defaults to
    /// [`DEFAULT_PREFILL_TOKEN_CAPACITY`]). Never busy when no threshold is set.
    pub fn is_busy(&self, active_prefill_tokens: u64, capacity: Option<u64>) -> bool {
        if let Some(t) = self.tokens
            && active_prefill_tokens > t
        {
            return true;
        }
        if let Some(f) = self.fraction {
            let cap = capacity.unwrap_or(DEFAULT_PREFILL_TOKEN_CAPACITY) as f64;
            return active_prefill_tokens as f64 > f * cap;
        }
        false
    }
}

/// `potential_decode_blocks > threshold · total_kv_blocks`; `None` if either is unknown.
pub fn decode_busy(
    potential_decode_blocks: u64,
    threshold: Option<f64>,
    total_kv_blocks: Option<u64>,
) -> Option<bool> {
    Some(potential_decode_blocks as f64 > threshold? * total_kv_blocks? as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_is_strictly_above_the_threshold() {
        let t = PrefillBusyThreshold {
            tokens: Some(100),
            fraction: None,
        };
        assert!(!t.is_busy(100, None));
        assert!(t.is_busy(101, None));
        let f = PrefillBusyThreshold {
            tokens: None,
            fraction: Some(0.5),
        };
        assert!(!f.is_busy(5_000_000, None));
        assert!(f.is_busy(5_000_001, None));
        assert!(f.is_busy(51, Some(100)));
        assert!(!PrefillBusyThreshold::default().is_busy(u64::MAX, Some(0)));
    }

    #[test]
    fn decode_busy_needs_both_inputs() {
        assert_eq!(decode_busy(10, Some(0.5), Some(20)), Some(false));
        assert_eq!(decode_busy(11, Some(0.5), Some(20)), Some(true));
        assert_eq!(decode_busy(11, None, Some(20)), None);
        assert_eq!(decode_busy(11, Some(0.5), None), None);
    }
}
