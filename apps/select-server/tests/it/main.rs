//! Integration tests of select-server: routes driven through `tower::ServiceExt::oneshot`
//! against a recording fake backend, with golden bodies from `spec/reference-transcript.md`.

mod auth;
mod binary;
mod fake;
mod http;
mod mesh;
mod routes;
mod serve;
mod shapes;
