//! How an operation that may not wait reports that it would have.

use crate::error::SelectionError;

/// The result of an operation asked not to wait.
#[derive(Debug)]
#[must_use]
pub enum Attempt<T, R> {
    /// It ran, without waiting (and succeeded or failed).
    Done(Result<T, SelectionError>),
    /// It would have waited; the request, unchanged, for a caller that may block. Nothing
    /// was booked, claimed or counted.
    WouldWait(R),
}

impl<T, R> Attempt<T, R> {
    /// The outcome of a call that was allowed to wait, which never stops early.
    pub(super) fn done(self) -> Result<T, SelectionError> {
        match self {
            Self::Done(r) => r,
            Self::WouldWait(_) => Err(SelectionError::internal(
                "an operation allowed to wait stopped as if it would wait",
            )),
        }
    }
}

/// Why a selection ended without a response.
pub(super) enum Stop {
    Failed(SelectionError),
    WouldWait,
}

impl From<SelectionError> for Stop {
    fn from(e: SelectionError) -> Self {
        Self::Failed(e)
    }
}

/// The outcome of a step that ran, or `None` when it stopped to avoid waiting.
pub(super) fn settled<T>(r: Result<T, Stop>) -> Option<Result<T, SelectionError>> {
    match r {
        Ok(v) => Some(Ok(v)),
        Err(Stop::Failed(e)) => Some(Err(e)),
        Err(Stop::WouldWait) => None,
    }
}

/// What a waiting operation ends with when its caller went away (nobody reads it; it
/// counts under `caller_gone`). 499 is the de facto "client closed request" status.
pub(super) fn caller_gone() -> SelectionError {
    SelectionError::scheduler(499, "the caller went away while the request waited")
}
