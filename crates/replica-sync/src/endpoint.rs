//! Endpoint syntax: the shared rule of `kv_types::endpoint`, plus what the mesh needs to
//! know to open a socket for it.

pub use kv_types::endpoint::{EndpointProblem, InvalidEndpoint, validate_endpoint};

/// Whether ZMQ needs its IPv6 option for this endpoint (bracketed TCP host).
pub(crate) fn is_bracketed_tcp(endpoint: &str) -> bool {
    endpoint.starts_with("tcp://[")
}
