//! The lock behind [`crate::SharedLedger`]: `parking_lot::Mutex` normally, a thin wrapper
//! over loom's mutex under `--cfg loom`, so the loom model in `tests/it/loom.rs` drives the
//! real [`crate::LoadHandle`] (`cargo xtask loom`). The wrapper has the two parking_lot
//! calls the crate and its tests use (`lock`, `Default`); normal builds never see it.

#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;

#[cfg(loom)]
pub(crate) use self::model::Mutex;

#[cfg(loom)]
#[allow(
    unreachable_pub,
    reason = "named by the public SharedLedger alias under cfg(loom)"
)]
mod model {
    /// loom's mutex with parking_lot's signature. Poisoning is ignored: a panicking model
    /// thread fails the whole loom run anyway.
    #[derive(Debug, Default)]
    pub struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }
}
