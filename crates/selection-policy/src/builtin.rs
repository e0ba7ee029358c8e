//! The built-in policy kinds by name, so that a server's policy file and an embedder's
//! builder choose among them the same way.

use crate::bounded::KvBoundedConfig;
use crate::candidate::PoolLabel;
use crate::config::{ConfigError, RouterConfig};
use crate::policy::Policy;

/// A built-in worker-selection policy and its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub enum BuiltinPolicy {
    /// The reference's cost function (`scheduling.md` §4): the compatibility contract.
    #[default]
    Default,
    /// Cache affinity under a load bound ([`KvBoundedConfig`]).
    KvBounded(KvBoundedConfig),
}

impl BuiltinPolicy {
    /// The policy-file spelling of the kind (`worker_selection.NAME.kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::KvBounded(_) => "kv-bounded",
        }
    }

    /// Checks the kind's parameters (the router configuration is validated on its own).
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            Self::Default => Ok(()),
            Self::KvBounded(c) => c.validate(),
        }
    }

    /// The policy object for one partition.
    pub fn build(&self, router: &RouterConfig, pool: PoolLabel) -> Policy {
        match self {
            Self::Default => Policy::default_policy(router, pool),
            Self::KvBounded(c) => c.policy(router),
        }
    }
}
