//! Integration tests of kv-index: the conformance cases of `spec/indexing.md` §11, a
//! proptest against a naive model, snapshot round trips, concurrency soaks (short and
//! pieced stores racing removals) and, with `--cfg loom`, a loom model of the pieced store.

mod concurrency;
mod conformance;
#[cfg(loom)]
mod loom;
mod model;
mod support;
