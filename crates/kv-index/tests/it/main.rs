//! Integration tests of kv-index: the conformance cases of `spec/indexing.md` §11, a
//! proptest against a naive model, snapshot round trips and a concurrency soak.

mod concurrency;
mod conformance;
mod model;
mod support;
