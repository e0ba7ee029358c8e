//! Criterion benchmarks of kv-select's hot paths (`cargo bench -p benches`).
//!
//! The library part only holds deterministic inputs shared by the bench targets (token
//! ids, a seeded service configuration, the service fleet of [`service_fixture`]), so
//! every bench measures the same work run after run.

pub mod ingest_stream;
pub mod service_fixture;

/// Deterministic pseudo-random token ids, `n` of them, from `seed` (the pickers' seeded
/// generator, so the same seed gives the same prompt on every run and platform).
pub fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = selection_policy::PickRng::seeded(seed);
    (0..n).map(|_| rng.below(150_000) as u32).collect()
}

/// A core configuration with a fixed random seed (so picks repeat run after run), with KV
/// events or in approximate mode.
pub fn seeded_config(use_kv_events: bool) -> service_builder::CoreConfig {
    service_builder::CoreConfig {
        router: selection_policy::RouterConfig {
            use_kv_events,
            ..selection_policy::RouterConfig::default()
        },
        rng_seed: Some(1),
        ..service_builder::CoreConfig::default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_deterministic() {
        assert_eq!(super::tokens(8, 3), super::tokens(8, 3));
        assert_ne!(super::tokens(8, 3), super::tokens(8, 4));
    }
}
