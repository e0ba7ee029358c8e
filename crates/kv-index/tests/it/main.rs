//! Integration tests of kv-index: the conformance cases of `spec/indexing.md` §11, a
//! proptest against a naive model, snapshot round trips, concurrency soaks (short and
//! pieced stores racing removals), two-copy cells against one index and, with `--cfg loom`, loom models of the pieced store
//! and of the read gate's hand-over.

mod concurrency;
mod conformance;
#[cfg(loom)]
mod loom;
#[cfg(loom)]
mod loom_gate;
mod model;
mod support;
mod twin;
