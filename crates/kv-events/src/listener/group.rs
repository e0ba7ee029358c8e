//! A listener group's thread: one `epoll` wait (through `mio`) over the sockets of all its
//! listeners, which adopts new listeners, ends stopped ones, times replays out and lets
//! each listener whose socket may be readable read it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::config::ListenerState;
use super::socket::{TOKENS_PER_SLOT, WAKE, monitor_token, register, sub_token};
use super::worker::Worker;
use crate::spares::Spares;

/// Longest wait of an idle group, after which it re-checks every socket (see the
/// `listener` module docs). Stop and open requests wake it at once, so this only bounds the
/// idle wake-ups: with a 100 ms slice per listener, 1,200 idle listeners took about a
/// quarter of a core.
pub(super) const IDLE_POLL_MS: u64 = 5_000;

/// What a group's handles and its thread share.
#[derive(Default)]
pub(super) struct GroupShared {
    /// Listeners started but not yet taken over by the thread.
    pub(super) pending: Mutex<Vec<Worker>>,
    pub(super) closed: AtomicBool,
    /// Listeners started on the group that have not ended.
    pub(super) listeners: AtomicUsize,
    /// The vectors its listeners' batches reuse (they all run on the group's thread, so
    /// the lock is never contended).
    pub(super) spares: Arc<Mutex<Spares>>,
}

/// The listeners a group's thread runs, by slot (a slot's tokens stay its own until it is
/// freed). Dropping it (also when the thread unwinds) ends every listener it holds or that
/// is still pending, so no `stop` waits forever.
struct Members<'a> {
    group: &'a GroupShared,
    registry: &'a mio::Registry,
    slots: Vec<Option<Worker>>,
    free: Vec<usize>,
}

impl Members<'_> {
    fn adopt(&mut self, mut worker: Worker) {
        let slot = self.free.pop().unwrap_or(self.slots.len());
        worker.slot = slot;
        worker.spares = Arc::clone(&self.group.spares);
        if let Err(e) = register(self.registry, worker.sub.get_fd(), sub_token(slot)) {
            self.group.listeners.fetch_sub(1, Ordering::AcqRel);
            worker.finish(self.registry, ListenerState::Failed { error: e });
            return;
        }
        if let Some(monitor) = &worker.monitor
            && let Err(e) = register(
                self.registry,
                monitor.reader().get_fd(),
                monitor_token(slot),
            )
        {
            // Without its descriptor the monitor is read by the periodic sweep only.
            tracing::warn!(error = %e, "KV-event connection monitor not polled");
        }
        if slot == self.slots.len() {
            self.slots.push(Some(worker));
        } else {
            self.slots[slot] = Some(worker);
        }
    }

    /// Ends the listener in `slot`. The group's count drops first: a `stop` returns as
    /// soon as the listener is marked ended.
    fn finish(&mut self, slot: usize, end: ListenerState) {
        if let Some(worker) = self.slots.get_mut(slot).and_then(Option::take) {
            self.group.listeners.fetch_sub(1, Ordering::AcqRel);
            worker.finish(self.registry, end);
            self.free.push(slot);
        }
    }

    fn workers(&mut self) -> impl Iterator<Item = &mut Worker> {
        self.slots.iter_mut().flatten()
    }

    fn finish_all(&mut self, end: &ListenerState) {
        for slot in 0..self.slots.len() {
            self.finish(slot, end.clone());
        }
    }
}

impl Drop for Members<'_> {
    fn drop(&mut self) {
        // Unwinding here means the group's own code panicked: every listener is failed, so
        // the service shows it, rather than stopped as if asked to.
        let end = if std::thread::panicking() {
            ListenerState::Failed {
                error: "the listener group's thread panicked".to_owned(),
            }
        } else {
            ListenerState::Stopped
        };
        let pending = std::mem::take(&mut *self.group.pending.lock());
        for worker in pending {
            self.group.listeners.fetch_sub(1, Ordering::AcqRel);
            worker.finish(self.registry, end.clone());
        }
        self.finish_all(&end);
    }
}

/// The group's thread: adopts new listeners, ends stopped ones, times replays out, and lets
/// each listener whose socket may be readable read it.
pub(super) fn run_group(group: &GroupShared, mut poll: mio::Poll) {
    let registry = match poll.registry().try_clone() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "KV-event listener group cannot start its poller");
            return;
        }
    };
    let mut members = Members {
        group,
        registry: &registry,
        slots: Vec::new(),
        free: Vec::new(),
    };
    let mut events = mio::Events::with_capacity(256);
    let idle = Duration::from_millis(IDLE_POLL_MS);
    let mut last_sweep = Instant::now();
    loop {
        let adopted = std::mem::take(&mut *group.pending.lock());
        for worker in adopted {
            members.adopt(worker);
        }
        if group.closed.load(Ordering::Acquire) {
            // Every handle is gone, so every listener was stopped; `Members` ends any left.
            return;
        }
        let now = Instant::now();
        for slot in 0..members.slots.len() {
            let stopping = match &mut members.slots[slot] {
                Some(w) if w.stopping() => true,
                Some(w) => {
                    w.check_deadline(&registry, now);
                    false
                }
                None => false,
            };
            if stopping {
                members.finish(slot, ListenerState::Stopped);
            }
        }
        let busy = members.workers().any(|w| w.has_work() || w.monitor_ready);
        let timeout = if busy {
            Duration::ZERO
        } else {
            let sweep = (last_sweep + idle).saturating_duration_since(now);
            members
                .workers()
                .filter_map(|w| w.deadline())
                .min()
                .map_or(sweep, |d| d.saturating_duration_since(now).min(sweep))
        };
        match poll.poll(&mut events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(error = %e, "waiting on KV-event sockets failed; the group's listeners stop");
                members.finish_all(&ListenerState::Failed {
                    error: e.to_string(),
                });
                // Not a hot loop if the error persists.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        }
        if last_sweep.elapsed() >= idle {
            // The periodic re-check of the `listener` module docs, however busy the group is.
            last_sweep = Instant::now();
            for w in members.workers() {
                w.sub_ready = true;
                w.dealer_ready = w.dealer.is_some();
                w.monitor_ready = w.monitor.is_some();
            }
        }
        for event in &events {
            let token = event.token();
            if token == WAKE {
                continue;
            }
            if let Some(Some(w)) = members.slots.get_mut(token.0 / TOKENS_PER_SLOT) {
                match token.0 % TOKENS_PER_SLOT {
                    0 => w.sub_ready = true,
                    1 => w.dealer_ready = true,
                    _ => w.monitor_ready = true,
                }
            }
        }
        // Connection events are read whether or not the listener's gate is open.
        for w in members.workers().filter(|w| w.monitor_ready) {
            w.read_monitor();
        }
        for slot in 0..members.slots.len() {
            let ended = match &mut members.slots[slot] {
                Some(w) if w.has_work() => read_guarded(w, &registry),
                _ => None,
            };
            if let Some(end) = ended {
                members.finish(slot, end);
            }
        }
    }
}

/// [`Worker::on_readable`], with a panic (a sink's bug, say) ending only that listener, as
/// failed: with a thread per listener a panic took one stream down, and a group must not
/// let it take down the others.
fn read_guarded(worker: &mut Worker, registry: &mio::Registry) -> Option<ListenerState> {
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        worker.on_readable(registry)
    }));
    match read {
        Ok(r) => r.err(),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".to_owned());
            Some(ListenerState::Failed {
                error: format!("panicked while handling KV events: {what}"),
            })
        }
    }
}
