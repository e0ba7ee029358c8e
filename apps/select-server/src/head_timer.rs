//! The timer behind the HTTP head timeout (connections.rs): one tokio timer entry per
//! connection instead of one per request.
//!
//! hyper arms a new sleep for every request head it waits for and drops it once the head is
//! in. With hyper-util's `TokioTimer` each of those sleeps is an entry inserted into the
//! runtime's timer wheel and removed again, which cost about 3 % of a `/select` at 16
//! keep-alive connections (docs/hot-path.md). Here all sleeps of a connection share one tokio
//! `Sleep`: a new sleep only records its deadline, and the shared entry moves when it fires
//! before the deadline of the sleep that polls it (at most once per timeout period, since a
//! connection's deadlines only grow). A sleep completes when a `TokioTimer` one would: never
//! before its deadline, and within the timer wheel's resolution after it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The tokio sleep a connection's head sleeps share; created at the first poll (inside the
/// runtime), not with the connection.
type Shared = Arc<Mutex<Option<Pin<Box<tokio::time::Sleep>>>>>;

/// One connection's timer (`http1::Builder::timer`); create one per connection.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConnectionTimer {
    shared: Shared,
}

impl hyper::rt::Timer for ConnectionTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(Instant::now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(HeadSleep {
            deadline,
            shared: Arc::clone(&self.shared),
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<HeadSleep>() {
            Some(mut head) => head.deadline = new_deadline,
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

/// A sleep of [`ConnectionTimer`].
struct HeadSleep {
    deadline: Instant,
    shared: Shared,
}

impl hyper::rt::Sleep for HeadSleep {}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = tokio::time::Instant::from_std(self.deadline);
        let mut shared = self.shared.lock();
        let sleep = shared.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.deadline() > deadline {
            // Armed for a later sleep than this one (hyper never does that, but a timer
            // must not fire late).
            sleep.as_mut().reset(deadline);
        }
        loop {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if sleep.deadline() >= deadline {
                return Poll::Ready(());
            }
            // It fired for an earlier sleep of this connection: wait on until this one's.
            sleep.as_mut().reset(deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer as _;

    const STEP: Duration = Duration::from_millis(60);

    #[tokio::test]
    async fn a_sleep_ends_at_its_own_deadline_whatever_the_earlier_ones_did() {
        let timer = ConnectionTimer::default();
        let start = Instant::now();
        // An earlier sleep arms the shared entry, then is dropped (a head that came in).
        let mut first = timer.sleep(STEP);
        assert!(futures_poll_once(&mut first).is_pending());
        drop(first);
        // A later one outlives the earlier deadline: it must not end there.
        tokio::time::sleep(STEP / 2).await;
        let second = timer.sleep(STEP);
        second.await;
        let waited = start.elapsed();
        assert!(waited >= STEP / 2 + STEP, "ended after {waited:?}");
        assert!(waited < STEP * 10, "ended after {waited:?}");
    }

    #[tokio::test]
    async fn reset_moves_the_deadline_both_ways() {
        let timer = ConnectionTimer::default();
        let start = Instant::now();
        let mut sleep = timer.sleep(STEP * 100);
        assert!(futures_poll_once(&mut sleep).is_pending());
        timer.reset(&mut sleep, Instant::now() + STEP);
        sleep.as_mut().await;
        let waited = start.elapsed();
        assert!(
            waited >= STEP && waited < STEP * 10,
            "ended after {waited:?}"
        );
        // Later than the shared entry's (already fired) deadline.
        timer.reset(&mut sleep, Instant::now() + STEP);
        let again = Instant::now();
        sleep.await;
        assert!(again.elapsed() >= STEP, "ended after {:?}", again.elapsed());
    }

    /// Polls once with a waker that does nothing.
    fn futures_poll_once(sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>) -> Poll<()> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        sleep.as_mut().poll(&mut cx)
    }
}
