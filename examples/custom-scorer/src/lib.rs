//! Example custom scorer: for requests of one policy class, prefer workers with fewer
//! active requests.
//!
//! It shows the whole plugin contract: depend on `selection-policy` and `kv-types` only,
//! implement [`Scorer`], write one finite lower-is-better contribution per candidate into
//! the caller's slice (no allocation), and let the service's builder register it next to
//! the default scorer, whose costs it is added to.
//!
//! Non-goals: it is an example, not a tuned policy. Invariant: it never writes a non-finite
//! value (the weight is validated at construction).

use selection_policy::{Candidate, PolicyError, Scorer, SelectionContext};

/// Adds `weight × active_requests` to the cost of every candidate when the request's policy
/// class is `class`; contributes 0 to other requests.
#[derive(Debug, Clone)]
pub struct FewestActiveRequests {
    class: String,
    weight: f64,
}

/// A weight that would make costs non-finite or reward load.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidWeight(pub f64);

// By hand rather than with thiserror, to keep the example's dependencies to the two crates.
impl std::error::Error for InvalidWeight {}

impl std::fmt::Display for InvalidWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "weight must be finite and non-negative, got {}", self.0)
    }
}

impl FewestActiveRequests {
    /// A scorer for `class` with `weight` cost blocks per active request.
    pub fn new(class: impl Into<String>, weight: f64) -> Result<Self, InvalidWeight> {
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(InvalidWeight(weight));
        }
        Ok(Self {
            class: class.into(),
            weight,
        })
    }
}

impl Scorer for FewestActiveRequests {
    fn score(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError> {
        let applies = ctx.policy_class == Some(self.class.as_str());
        for (c, out) in candidates.iter().zip(costs.iter_mut()) {
            let requests = c.load.map_or(0, |l| l.active_requests);
            *out = if applies {
                self.weight * requests as f64
            } else {
                0.0
            };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_types::WorkerKey;
    use selection_policy::{
        DefaultScorer, LoadInputs, PickRng, Policy, PoolLabel, RouterConfig, Scratch,
        TemperaturePicker,
    };

    fn candidate(id: u64, decode_blocks: u64, requests: u64) -> Candidate {
        Candidate {
            load: Some(LoadInputs {
                active_prefill_tokens: 0,
                potential_decode_blocks: decode_blocks,
                active_requests: requests,
            }),
            ..Candidate::new(WorkerKey::new(id, 0))
        }
    }

    #[test]
    fn steers_only_its_class_through_the_policy_traits() {
        let config = RouterConfig::default();
        let policy = Policy::new(
            &config,
            vec![
                Box::new(DefaultScorer::new(&config, PoolLabel::Decode)),
                Box::new(FewestActiveRequests::new("batch", 4.0).unwrap()),
            ],
            Box::new(TemperaturePicker::new(&config)),
        );
        // Worker 1 has fewer decode blocks but many requests.
        let rows = [candidate(1, 10, 5), candidate(2, 14, 1)];
        let mut scratch = Scratch::default();
        let mut rng = PickRng::seeded(0);

        let mut ctx = SelectionContext::new(32, 16, 2);
        let plain = policy.select(&ctx, &rows, &mut scratch, &mut rng).unwrap();
        assert_eq!(plain.worker, WorkerKey::new(1, 0));
        assert_eq!(scratch.costs(), &[12.0, 16.0]);

        ctx.policy_class = Some("batch");
        let steered = policy.select(&ctx, &rows, &mut scratch, &mut rng).unwrap();
        assert_eq!(steered.worker, WorkerKey::new(2, 0));
        assert_eq!(scratch.costs(), &[32.0, 20.0]);
    }

    #[test]
    fn rejects_weights_that_would_break_the_cost_contract() {
        assert!(FewestActiveRequests::new("c", f64::NAN).is_err());
        assert!(FewestActiveRequests::new("c", -1.0).is_err());
        assert_eq!(
            InvalidWeight(-1.0).to_string(),
            "weight must be finite and non-negative, got -1"
        );
    }
}
