//! `kv-bounded`: cache affinity under a load bound, a built-in alternative to the default
//! cost function, composed from the public [`Scorer`] / [`Picker`] traits like any custom
//! policy.
//!
//! A candidate's load is the default cost's load terms in blocks: tracked prefill tokens
//! over the block size plus `decode_weight ×` its potential decode blocks. A candidate is
//! *admissible* when its load is within `slack` request-sizes of the least-loaded
//! candidate. Admissible candidates rank before every other one; among them the longest
//! effective prefix wins, then the lower load; the rest rank by load.
//!
//! Why a bound instead of a weight: in the default cost one cached block buys one block of
//! load, and the credit is clamped inside `max(0, prefill − credit)`, so a worker holding a
//! few more cached blocks loses to a slightly idler one and no configuration of the formula
//! lets cache decide often. A bound in units of the request being placed compares like with
//! like: cache decides whenever the load gap is small against the work being placed, load
//! decides otherwise, and a hot prefix cannot pile everything onto one worker because its
//! holder stops being admissible once it is `slack` requests ahead of the idlest.

use crate::candidate::{Candidate, SelectionContext};
use crate::config::{ConfigError, RouterConfig};
use crate::default::TemperaturePicker;
use crate::policy::Policy;
use crate::traits::{PolicyError, Scorer};

/// Parameters of the `kv-bounded` policy. `Default` is the recommended set
/// (docs/routing-quality.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvBoundedConfig {
    /// Admissible load gap to the least-loaded candidate, in units of this request's
    /// blocks. `0` admits only the least-loaded candidates (ties broken by cache); a very
    /// large value is greedy longest-prefix.
    pub slack: f64,
    /// Weight of a candidate's potential decode blocks in its load (the default cost
    /// weighs them 1, like prefill blocks). Below 1 the bound is mostly one of queued
    /// prefill work, which is what delays a new request's first token; above 0 the KV
    /// blocks held by running requests still count, so that one worker does not take every
    /// long decode.
    pub decode_weight: f64,
}

impl Default for KvBoundedConfig {
    fn default() -> Self {
        Self {
            slack: 4.0,
            decode_weight: 0.5,
        }
    }
}

impl KvBoundedConfig {
    /// Largest accepted `slack`: beyond it the bound admits every candidate of any real
    /// fleet and the value is more likely a typo than a choice.
    pub const MAX_SLACK: f64 = 1e6;

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.slack.is_finite() && (0.0..=Self::MAX_SLACK).contains(&self.slack)) {
            return Err(ConfigError::OutOfRange {
                field: "slack",
                value: self.slack,
                min: 0.0,
                max: Self::MAX_SLACK,
            });
        }
        if !(self.decode_weight.is_finite() && self.decode_weight >= 0.0) {
            return Err(ConfigError::NotFiniteNonNegative {
                field: "decode_weight",
                value: self.decode_weight,
            });
        }
        Ok(())
    }

    /// The policy: a [`BoundedCacheScorer`], the minimum picker (uniform among exact ties)
    /// and exclusive session affinity, as the default policy has. `router` supplies the
    /// host and disk cache-hit weights and the result settings.
    pub fn policy(&self, router: &RouterConfig) -> Policy {
        Policy::new(
            router,
            vec![Box::new(BoundedCacheScorer::new(self, router))],
            Box::new(TemperaturePicker::new(&RouterConfig {
                router_temperature: 0.0,
                ..router.clone()
            })),
        )
        .with_exclusive_affinity(true)
    }
}

/// The scorer of [`KvBoundedConfig::policy`].
#[derive(Debug, Clone, Copy)]
pub struct BoundedCacheScorer {
    slack: f64,
    decode_weight: f64,
    w_host: f64,
    w_disk: f64,
}

/// Cost offset of inadmissible candidates. Loads and prefixes are counts of blocks of a
/// real fleet (far below 1e12), so the admissible range `[-blocks, 0]` and the inadmissible
/// range `[TIER, TIER + load]` never meet and both stay exact in an `f64`.
const TIER: f64 = 1e12;

/// Weight of the load as the tie-break among admissible candidates with the same prefix:
/// small enough that a whole block of prefix outweighs any load difference below 1e6
/// blocks.
const LOAD_TIE_BREAK: f64 = 1e-6;

impl BoundedCacheScorer {
    pub fn new(config: &KvBoundedConfig, router: &RouterConfig) -> Self {
        Self {
            slack: config.slack,
            decode_weight: config.decode_weight,
            w_host: router.host_cache_hit_weight,
            w_disk: router.disk_cache_hit_weight,
        }
    }

    /// A candidate's load in blocks.
    #[inline]
    fn load(&self, inv_block: f64, c: &Candidate) -> f64 {
        c.load.map_or(0.0, |l| {
            l.active_prefill_tokens as f64 * inv_block
                + self.decode_weight * l.potential_decode_blocks as f64
        })
    }
}

impl Scorer for BoundedCacheScorer {
    fn score(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        let inv_block = 1.0 / f64::from(ctx.block_size.max(1));
        let least = candidates
            .iter()
            .map(|c| self.load(inv_block, c))
            .fold(f64::INFINITY, f64::min);
        let bound = least + self.slack * ctx.request_blocks().max(1) as f64;
        for (c, out) in candidates.iter().zip(costs.iter_mut()) {
            let load = self.load(inv_block, c);
            *out = if load <= bound {
                // A preferred taint (multiplier below 1) strengthens the affinity.
                let prefix = c.cache.effective_overlap_blocks(self.w_host, self.w_disk);
                -prefix / c.preferred_taint_multiplier + LOAD_TIE_BREAK * load
            } else {
                TIER + load
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::{CacheInputs, LoadInputs};
    use crate::policy::Scratch;
    use crate::rng::PickRng;
    use kv_types::WorkerKey;

    fn cand(worker: u64, device: u32, decode: u64) -> Candidate {
        Candidate {
            cache: CacheInputs {
                device_blocks: device,
                ..CacheInputs::default()
            },
            load: Some(LoadInputs {
                active_prefill_tokens: 0,
                potential_decode_blocks: decode,
                active_requests: 0,
            }),
            ..Candidate::new(WorkerKey::new(worker, 0))
        }
    }

    /// Loads here are decode blocks only, weighed 1.
    fn pick(slack: f64, rows: &[Candidate]) -> u64 {
        let cfg = KvBoundedConfig {
            slack,
            decode_weight: 1.0,
        };
        let policy = cfg.policy(&RouterConfig::default());
        // 160 tokens of 16: a 10-block request.
        let ctx = SelectionContext::new(160, 16, 10);
        policy
            .select(&ctx, rows, &mut Scratch::default(), &mut PickRng::seeded(3))
            .map(|s| s.worker.worker_id.0)
            .unwrap()
    }

    #[test]
    fn cache_decides_within_the_bound_and_load_outside_it() {
        let rows = [cand(1, 0, 100), cand(2, 4, 108), cand(3, 9, 111)];
        // Slack 1: loads up to 110 admissible, so worker 2's 4 blocks win.
        assert_eq!(pick(1.0, &rows), 2);
        // Slack 2: worker 3 is admissible too and holds more.
        assert_eq!(pick(2.0, &rows), 3);
        // Slack 0: only the least-loaded is admissible.
        assert_eq!(pick(0.0, &rows), 1);
    }

    #[test]
    fn equal_prefix_goes_to_the_lower_load() {
        let rows = [cand(1, 5, 104), cand(2, 5, 101), cand(3, 0, 100)];
        assert_eq!(pick(1.0, &rows), 2);
    }

    #[test]
    fn inadmissible_rows_rank_by_load_after_every_admissible_one() {
        let cfg = KvBoundedConfig {
            slack: 0.5,
            decode_weight: 1.0,
        };
        let s = BoundedCacheScorer::new(&cfg, &RouterConfig::default());
        let ctx = SelectionContext::new(160, 16, 10);
        let rows = [cand(1, 0, 100), cand(2, 50, 300), cand(3, 90, 200)];
        let mut costs = [f64::NAN; 3];
        s.score(&ctx, &rows, &mut costs).unwrap();
        assert!(costs[0] < costs[2] && costs[2] < costs[1], "{costs:?}");
    }

    #[test]
    fn validation_names_the_field() {
        let bad = KvBoundedConfig {
            slack: -1.0,
            ..KvBoundedConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("slack"));
        let bad = KvBoundedConfig {
            decode_weight: f64::NAN,
            ..KvBoundedConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("decode_weight")
        );
        KvBoundedConfig::default().validate().unwrap();
    }
}
