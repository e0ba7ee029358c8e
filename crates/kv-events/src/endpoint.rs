//! Endpoint syntax validation before connecting (`spec/kv-events.md` §2.2): the shared rule
//! of `kv_types::endpoint`, re-exported under this crate's historical name.

/// Why an endpoint string was rejected (displays the contract's wording).
pub use kv_types::endpoint::InvalidEndpoint as EndpointError;
pub use kv_types::endpoint::validate_endpoint;
