//! The plugin surface: the roles a policy is made of ([`Filter`], [`Scorer`], [`Picker`])
//! and the error they share. The built-in scorers and pickers and the policy that composes
//! them build on this file; it imports only the row types it is written over.

use std::fmt;

use kv_types::WorkerKey;

use crate::candidate::{Candidate, SelectionContext};
use crate::rng::PickRng;

/// A failed selection.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// No candidate was offered (the service maps this to `NoEndpoints` or
    /// `AllEligibleWorkersOverloaded` from what it knows about eligibility).
    #[error("no candidates")]
    NoCandidates,
    /// Filters rejected every candidate (`AllEligibleWorkersFiltered`, 503).
    #[error("all eligible workers were filtered out by the selection policy")]
    AllFiltered,
    /// The pinned worker is not among the candidates.
    #[error("pinned {worker} is not a candidate")]
    PinnedNotCandidate { worker: WorkerKey },
    /// A scorer wrote a non-finite cost (or left a row unwritten) (500).
    #[error("scorer {scorer} produced a non-finite cost {value} for row {row}")]
    NonFiniteCost {
        scorer: usize,
        row: usize,
        value: f64,
    },
    /// The picker returned a row that does not exist (500).
    #[error("picker returned row {row} of {len}")]
    RowOutOfRange { row: usize, len: usize },
    /// A custom component failed (500).
    #[error("selection policy component failed: {message}")]
    Component { message: String },
}

/// Keeps or drops one candidate; filters run in declaration order.
pub trait Filter: Send + Sync + fmt::Debug {
    fn keep(&self, ctx: &SelectionContext<'_>, candidate: &Candidate) -> Result<bool, PolicyError>;
}

/// Writes one finite, lower-is-better cost per candidate into `costs` (same length as
/// `candidates`, pre-filled with NaN so an unwritten row is caught). The contributions of
/// all scorers are summed.
pub trait Scorer: Send + Sync + fmt::Debug {
    fn score(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &mut [f64],
    ) -> Result<(), PolicyError>;
}

/// Chooses one row given the summed costs.
pub trait Picker: Send + Sync + fmt::Debug {
    fn pick(
        &self,
        ctx: &SelectionContext<'_>,
        candidates: &[Candidate],
        costs: &[f64],
        rng: &mut PickRng,
    ) -> Result<usize, PolicyError>;
}
