//! The service's error: a stable kind, the HTTP status it maps to, and a plain message.

use std::fmt;

/// Stable error categories (`spec/http-api.md` §2).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ErrorKind {
    BadRequest,
    NotReady,
    NotFound,
    Conflict,
    Internal,
    Scheduler,
    Sequence,
    /// A bounded resource (reservations, queue) is full.
    ResourceExhausted,
}

impl ErrorKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::NotReady => "not_ready",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Internal => "internal",
            ErrorKind::Scheduler => "scheduler",
            ErrorKind::Sequence => "sequence",
            ErrorKind::ResourceExhausted => "resource_exhausted",
        }
    }
}

/// Extra structured data of a 429 queue rejection.
#[derive(Clone, PartialEq, Debug)]
pub struct RejectionDetails {
    pub policy_class: String,
    pub limit_kind: String,
    pub current: u64,
    pub limit: u64,
}

/// Every failure of a service operation.
#[derive(Clone, PartialEq, Debug)]
pub struct SelectionError {
    kind: ErrorKind,
    status: u16,
    message: String,
    details: Option<RejectionDetails>,
}

impl SelectionError {
    pub fn new(kind: ErrorKind, status: u16, message: impl Into<String>) -> Self {
        Self {
            kind,
            status,
            message: message.into(),
            details: None,
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadRequest, 400, message)
    }
    pub fn not_ready(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotReady, 503, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, 404, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, 409, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, 500, message)
    }
    pub fn scheduler(status: u16, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Scheduler, status, message)
    }
    pub fn sequence(status: u16, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Sequence, status, message)
    }
    pub(crate) fn with_details(mut self, details: RejectionDetails) -> Self {
        self.details = Some(details);
        self
    }
    pub(crate) fn shutting_down() -> Self {
        Self::not_ready("selection service is shutting down")
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The HTTP status this error maps to.
    pub fn status_code(&self) -> u16 {
        self.status
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    pub fn details(&self) -> Option<&RejectionDetails> {
        self.details.as_ref()
    }
}

impl fmt::Display for SelectionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SelectionError {}

/// Why [`crate::SelectionServiceBuilder::build`] refused a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    #[error("session affinity TTL must be between 1 and 31536000 seconds")]
    SessionAffinityTtl,
    #[error("--replica-sync-peers requires --replica-sync-port")]
    ReplicaPeersWithoutPort,
    #[error("replica sync port must be greater than zero")]
    ReplicaPortZero,
    #[error("invalid router configuration: {0}")]
    RouterConfig(String),
    #[error("selection cache {field} must be greater than zero")]
    SelectionCache { field: &'static str },
    /// A built-in policy's parameters are invalid (the error names the field).
    #[error("invalid worker-selection policy: {0}")]
    Policy(selection_policy::ConfigError),
    #[error("failed to start: {0}")]
    Startup(String),
}
