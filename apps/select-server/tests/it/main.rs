//! Integration tests of select-server: routes driven through `tower::ServiceExt::oneshot`
//! over the real service in process (`harness`), with golden bodies from
//! `spec/reference-transcript.md`.

mod auth;
mod binary;
mod bounds;
mod ext_proc;
mod ext_proc_fallbacks;
mod ext_proc_kv;
mod ext_proc_metrics;
mod ext_proc_startup;
mod ext_proc_tls;
mod faults;
mod harness;
mod http;
mod mesh;
mod routes;
mod select_bytes;
mod serve;
mod shapes;
mod transcript;
mod vllm_interop;
