//! kv-select as a Kubernetes Gateway API Inference Extension (GIE) endpoint picker: the
//! gateway (Envoy, or any proxy speaking Envoy's external-processing protocol) opens one
//! `envoy.service.ext_proc.v3.ExternalProcessor/Process` stream per HTTP request, and this
//! crate answers with the `ip:port` of the worker to send it to.
//!
//! # Responsibility
//! - The ext_proc conversation (`stream.rs`): the decision in the
//!   `x-gateway-destination-endpoint` header and in `dynamic_metadata["envoy.lb"]`, the
//!   subset hint of `metadata_context["envoy.lb.subset_hint"]` as the candidate
//!   allow-list, 503 / 429 as immediate responses, the body passed on unchanged, the
//!   served endpoint of the response's `metadata_context` moving the booking.
//! - Reading OpenAI request bodies (`request.rs`) and tokenizing them as the engine does
//!   (`tokenize.rs`: `tokenizer.json` via Hugging Face `tokenizers`, the chat template of
//!   `tokenizer_config.json` via minijinja), so the block hashes of the routed tokens are
//!   those of the engines' KV events. Hashing itself is the service's: the picker hands it
//!   token ids exactly as `POST /select_and_reserve` does.
//! - The booking lifecycle bound to the stream (`picker.rs`): pick = select and reserve,
//!   first response body chunk = prefill complete, end of the response = free, and a
//!   [`Booking`] guard frees whatever a broken or cancelled stream left.
//! - `grpc.health.v1` (`server.rs`): `liveness`, `readiness` and the ext_proc service name.
//!
//! # Non-goals
//! No selection logic, hashing or state of its own: everything goes through
//! `service-builder`'s public API, on the same service instance the HTTP API serves. No
//! configuration parsing (the app owns the flags) and no downloading: tokenizers are read
//! from local directories at startup.
//!
//! # Invariants
//! - A request is never rejected for its body: a body that is not JSON, not a completion
//!   or chat request, or that cannot be tokenized is routed by load only, and counted per
//!   reason in `kv_select_ext_proc_load_only_picks_total`.
//! - Every booking made for a stream is freed exactly once, whichever way the stream ends
//!   (`kv_select_ext_proc_stream_events_total{event="completed"|"cancelled"}`).
//!
//! # Design choices
//! - Envoy's generated types come from `envoy-types` (tonic/prost of the same versions)
//!   instead of vendored protos and a build script: no `protoc` in the build.
//! - Tokenizing runs on tokio's blocking pool: a long chat costs milliseconds of CPU,
//!   which would stall the async workers that serve every other stream.
//! - The service has no "move a booking" operation; a served endpoint that differs from
//!   the booked one frees the booking and books the served worker explicitly with the
//!   same prompt (`Booking::move_to`).

mod endpoint;
mod error;
mod metrics;
mod picker;
mod request;
mod server;
mod stream;
mod tokenize;

pub use endpoint::endpoint_address;
pub use error::{ServeError, TokenizerError};
pub use metrics::{ExtProcMetrics, PickOutcome, StreamEvent};
pub use picker::{Booking, PickError, PickInput, Picker, PickerConfig};
pub use request::{InferenceRequest, LoadOnlyReason, parse as parse_request};
pub use server::{ExtProcService, TlsFiles, serve};
pub use stream::{DESTINATION_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE};
pub use tokenize::{EncodeError, ModelTokenizer, Tokenizers};
