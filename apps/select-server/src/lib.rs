//! HTTP edge of kv-select: the routes of `spec/http-api.md` as a `tower::Service`, the JSON
//! DTOs of that contract, and the CLI/environment configuration.
//!
//! # Responsibility
//! Everything about HTTP that needs no selection state: routing (404/405 as JSON), path
//! parameters, body rejections (415 content type, 413 over 8 MiB, 400 syntax including
//! trailing bytes, 422 shape naming the field), nesting-depth and array-length bounds,
//! stateless request validation (`decay_fraction`, `router_config_override` ranges), the
//! `x-dynamo-meta-policy-class` header, optional bearer-token auth (full and read-only
//! tokens, [`auth`]), and response rendering
//! exactly per contract (omitted-when rules, signed hashes, string rank keys, envelopes).
//!
//! # Non-goals
//! No selection logic: every route delegates to a [`Backend`]; [`ServiceBackend`] implements it
//! over the in-process `service-builder` service.
//! Prompt rules of §3.3 are *not* applied here although they are stateless: the contract
//! orders them after readiness (a bad prompt on an unready partition is 503, not 400) and,
//! for explicit reservations, after discarding the cached selection. The service applies
//! them; the edge only moves the prompt members into its request types.
//!
//! # Invariants
//! - A rejected body reaches no backend method (nothing changes).
//! - Only [`config`] reads environment variables, once, at startup.
//! - Hashes are `u64` everywhere; the signed rendering exists only in [`dto`]'s serde helpers.
//!
//! # Design choices
//! - The backend is a generic trait with `impl Future + Send` methods rather than a boxed
//!   `dyn` object: one static dispatch per request, no `async-trait` dependency.
//! - Request bodies with prompt fields deserialize through private wire structs listing those
//!   fields inline instead of `#[serde(flatten)]`, which would buffer a 500k-token array into
//!   an intermediate tree and lose the field path in error messages.
//! - Depth and array length are checked by one linear pre-scan of the buffered bytes, before
//!   serde allocates anything (defaults: depth 32, 2,097,152 elements per array — above the
//!   4.2 M-token 8 MiB worst case only for bodies of single-digit token ids). A vectorized
//!   count of openers and commas skips the exact scan when it cannot fail.
//! - The selection routes have a fast path (docs/hot-path.md): `token_ids` is cut out of the
//!   body and parsed by a dedicated loop, the rest by serde without path tracking; anything
//!   unusual falls back to the exact parse, so error messages are those of serde. Members a
//!   body type skips are checked for what serde_json rejects only in a value it keeps (an
//!   out-of-range number, a bad string): a cheap byte screen clears most bodies, and only
//!   the part the dedicated loop did not parse is screened.

pub mod auth;
pub mod backend;
mod body;
pub mod config;
mod connections;
mod discovery;
pub mod dto;
mod head_timer;
pub mod policy_file;
mod recovery;
mod routes;
mod server;
mod service_backend;
mod tokens;

pub use auth::{Access, AccessTokens, PeerToken, TokenFileError};
pub use backend::{ApiError, ApiResult, Backend, ErrorBody, QueueLimitKind};
pub use body::BodyLimits;
pub use connections::HttpThreads;
pub use discovery::WorkersFileWatcher;
pub use recovery::recover_from_peers;
pub use routes::{EdgeOptions, HttpResponse, POLICY_CLASS_HEADER, Routes, error_response, router};
pub use server::{
    OpenFileLimit, WorkersFileError, raise_open_file_limit, read_workers_file, serve,
    serve_on_threads,
};
pub use service_backend::{ServiceBackend, build_service};
pub use tokens::split_token_ids;
