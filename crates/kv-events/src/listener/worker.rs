//! One listener's state, owned by its group's thread: reading the live SUB, the sequence
//! watermark and its gaps, the replay state machine over the DEALER (`spec/kv-events.md`
//! §10), and handing decoded batches to the sink.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_types::{KvOperation, KvOperationKind};
use parking_lot::{Condvar, Mutex};
use zmq_monitor::Monitor;

use super::config::{KvEventSink, ListenerConfig, ListenerState};
use super::socket::{
    dealer_token, deregister, new_socket, on_connection_event, recv_frames, register,
};
use crate::decode::{FrameError, parse_live_frames, parse_seq};
use crate::normalize::{LogLimiter, Normalizer};
use crate::spares::Spares;
use crate::stats::{DropReason, ListenerStats};
use crate::watermark::{SeqObservation, Watermark};

/// Messages one listener may handle per poll round before the group polls again, so that a
/// flooding publisher cannot starve the rest of its group. Public for benches that hand an
/// index batches in the order a listener reads full queues.
pub const READ_BURST: usize = 64;
/// Monitor events read per listener and poll round.
const MONITOR_BURST: usize = 64;
/// Decoded batches a listener holds before it hands them to the sink in one call
/// ([`KvEventSink::apply_batches`]): enough that the service's writers take their turn on
/// a partition once per few batches of a burst instead of once per batch (each turn
/// another listener waited for is a futex wake-up and a context switch), few enough that
/// a turn stays well under a millisecond.
const PENDING_BATCHES: usize = 8;
/// Operations past which the held batches go to the sink whatever their count.
const PENDING_OPS: usize = 256;

/// What a listener's handle and its state on the group's thread share.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) stop: AtomicBool,
    pub(super) open: AtomicBool,
    /// `u64::MAX` = no batch applied yet (as the reference's sentinel).
    pub(super) watermark: AtomicU64,
    pub(super) state: Mutex<ListenerState>,
    /// Signalled once the group has let go of the listener (its sockets are closed by then
    /// and `state` is no longer `Running`).
    pub(super) ended: Condvar,
    pub(super) stats: Arc<ListenerStats>,
}

/// Why a replay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayEnd {
    Marker,
    BadResponse,
    TimedOut,
    Stopped,
    SendFailed,
}

/// A gap being filled by the engine's replay socket.
struct Replay {
    start: u64,
    end: u64,
    /// The first seq of `[start, end)` not already accounted for (an undecodable batch
    /// counted as dropped is not lost again).
    from: u64,
    /// Replayed seqs of `[from, end)` applied or counted as dropped: the rest are lost.
    taken: u64,
    deadline: Instant,
    first: Option<u64>,
    last: Option<u64>,
    contiguous: bool,
    /// The live batch that revealed the gap, applied once the replay is over.
    held: (u64, Vec<zmq::Message>),
}

enum Mode {
    /// Reading the SUB socket (once the ready gate is open).
    Live,
    /// Reading the DEALER until the end marker, a bad answer or the deadline; live
    /// messages wait in the SUB queue meanwhile.
    Replaying(Box<Replay>),
}

/// One listener's state, owned by its group's thread.
pub(super) struct Worker {
    ctx: zmq::Context,
    config: ListenerConfig,
    pub(super) sub: zmq::Socket,
    /// The SUB's connection events. Silenced before it is closed (see `Drop`).
    pub(super) monitor: Option<Monitor>,
    pub(super) dealer: Option<zmq::Socket>,
    /// Index in the group (its poller tokens).
    pub(super) slot: usize,
    /// The SUB may have a message: an edge of its `ZMQ_FD` came, or it was not read empty.
    pub(super) sub_ready: bool,
    /// The same for the monitor.
    pub(super) monitor_ready: bool,
    /// The same for the DEALER.
    pub(super) dealer_ready: bool,
    mode: Mode,
    sink: Arc<dyn KvEventSink>,
    shared: Arc<Shared>,
    normalizer: Normalizer,
    watermark: Watermark,
    /// The highest live seq already accounted for: applied, dropped as undecodable, or
    /// counted lost. A batch that fails to decode leaves the watermark below it (§3), so
    /// every later batch reports a gap over it again; only seqs past this one are lost.
    accounted: Option<u64>,
    /// The operations of the decoded batches not yet handed to the sink, in order.
    ops: Vec<KvOperation>,
    /// Where each held batch's operations end in `ops`, and its seq.
    pending: Vec<(usize, u64)>,
    /// The vectors of events and operations kept for the next batch: the group's, once it
    /// adopts this listener.
    pub(super) spares: Arc<Mutex<Spares>>,
    /// One limiter per drop reason: a shared one hid a new reason behind the count of an
    /// old one (only occurrences 1-3 and powers of two are logged).
    drop_log: [LogLimiter; DropReason::ALL.len()],
    stale_log: LogLimiter,
    /// Gaps that lost batches and replays that came back incomplete.
    loss_log: LogLimiter,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(monitor) = self.monitor.take() {
            monitor.stop(&self.sub);
        }
    }
}

/// The payload frame of a live message (`[topic, seq, payload]`, checked when parsed).
fn live_payload(frames: &[zmq::Message]) -> &[u8] {
    frames.get(2).map_or(&[], |m| &m[..])
}

impl Worker {
    /// A listener's state as its group's thread takes it over: live, its SUB (and monitor)
    /// worth checking, no DEALER before its first replay.
    pub(super) fn new(
        ctx: &zmq::Context,
        config: ListenerConfig,
        sub: zmq::Socket,
        monitor: Option<Monitor>,
        sink: Arc<dyn KvEventSink>,
        shared: &Arc<Shared>,
    ) -> Self {
        Worker {
            ctx: ctx.clone(),
            normalizer: Normalizer::new(config.worker, config.block_size),
            watermark: match config.initial_watermark {
                Some(v) => Watermark::Live(v),
                None => Watermark::Initial,
            },
            accounted: None,
            config,
            sub,
            monitor,
            dealer: None,
            slot: 0,
            sub_ready: true,
            monitor_ready: true,
            dealer_ready: false,
            mode: Mode::Live,
            sink,
            shared: Arc::clone(shared),
            ops: Vec::new(),
            pending: Vec::new(),
            spares: Arc::default(),
            drop_log: Default::default(),
            stale_log: LogLimiter::default(),
            loss_log: LogLimiter::default(),
        }
    }

    pub(super) fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Whether the group should let this listener read now: its current socket may have a
    /// message (the SUB only once the gate is open).
    pub(super) fn has_work(&self) -> bool {
        match self.mode {
            Mode::Replaying(_) => self.dealer_ready,
            Mode::Live => self.sub_ready && self.shared.open.load(Ordering::Acquire),
        }
    }

    pub(super) fn deadline(&self) -> Option<Instant> {
        match &self.mode {
            Mode::Replaying(r) => Some(r.deadline),
            Mode::Live => None,
        }
    }

    pub(super) fn check_deadline(&mut self, registry: &mio::Registry, now: Instant) {
        if self.deadline().is_some_and(|d| now >= d) {
            self.end_replay(registry, ReplayEnd::TimedOut);
            self.flush();
        }
    }

    /// Closes the sockets, then publishes the end state and wakes whoever waits in `stop`.
    pub(super) fn finish(mut self, registry: &mio::Registry, end: ListenerState) {
        if matches!(self.mode, Mode::Replaying(_)) {
            self.end_replay(registry, ReplayEnd::Stopped);
        }
        self.flush();
        deregister(registry, &self.sub);
        let monitor = self.monitor.as_ref().map(Monitor::reader);
        for socket in [monitor, self.dealer.as_ref()].into_iter().flatten() {
            deregister(registry, socket);
        }
        if let ListenerState::Failed { error } = &end {
            let wid = self.config.worker.worker_id.0;
            let rank = self.config.worker.dp_rank.0;
            tracing::error!(worker_id = wid, dp_rank = rank, error = %error, "live KV-event socket failed; listener stopped");
        }
        let shared = Arc::clone(&self.shared);
        drop(self);
        *shared.state.lock() = end;
        shared.ended.notify_all();
    }

    /// Applies up to [`MONITOR_BURST`] connection events; clears the ready flag once
    /// `ZMQ_EVENTS` shows the monitor empty.
    pub(super) fn read_monitor(&mut self) {
        let Some(monitor) = &self.monitor else {
            self.monitor_ready = false;
            return;
        };
        for _ in 0..MONITOR_BURST {
            match monitor.next_event() {
                Some(event) => on_connection_event(&self.shared.stats, &event),
                None => break,
            }
        }
        if !monitor
            .reader()
            .get_events()
            .is_ok_and(|e| e.contains(zmq::POLLIN))
        {
            self.monitor_ready = false;
        }
    }

    /// Reads up to [`READ_BURST`] messages of the current socket. Clears its ready flag only when
    /// `ZMQ_EVENTS` shows it empty, so a listener cut off by the burst limit is let back in
    /// without waiting for an edge. `Err` ends the listener. Every batch it decoded has
    /// reached the sink when it returns.
    pub(super) fn on_readable(&mut self, registry: &mio::Registry) -> Result<(), ListenerState> {
        let read = self.read_burst(registry);
        self.flush();
        read
    }

    fn read_burst(&mut self, registry: &mio::Registry) -> Result<(), ListenerState> {
        for _ in 0..READ_BURST {
            if self.stopping() {
                break;
            }
            let replaying = matches!(self.mode, Mode::Replaying(_));
            let socket = match (replaying, &self.dealer) {
                (false, _) => &self.sub,
                (true, Some(dealer)) => dealer,
                (true, None) => {
                    self.end_replay(registry, ReplayEnd::SendFailed);
                    continue;
                }
            };
            let readable = socket.get_events().map(|e| e.contains(zmq::POLLIN));
            let received = match readable {
                Ok(true) => recv_frames(socket),
                Ok(false) => Ok(None),
                Err(e) => Err(e),
            };
            match received {
                Ok(None) => {
                    // Read empty: only a new edge brings this socket back.
                    if replaying {
                        self.dealer_ready = false;
                    } else {
                        self.sub_ready = false;
                    }
                    break;
                }
                Err(zmq::Error::EINTR) => {}
                Ok(Some((frames, count))) if replaying => {
                    self.on_replayed(registry, &frames, count);
                }
                Ok(Some((frames, count))) => self.on_live(registry, frames, count),
                Err(_) if replaying => self.end_replay(registry, ReplayEnd::BadResponse),
                Err(e) => {
                    return Err(ListenerState::Failed {
                        error: e.to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    fn on_live(&mut self, registry: &mio::Registry, frames: Vec<zmq::Message>, count: usize) {
        let parsed = if count == frames.len() {
            let slices: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
            parse_live_frames(&slices).map(|m| m.seq)
        } else {
            Err(FrameError::WrongFrameCount { count })
        };
        let seq = match parsed {
            Ok(seq) => seq,
            Err(e) => {
                self.drop_message(DropReason::from(&e), &e);
                return;
            }
        };
        let frames = match self.watermark.observe(seq) {
            SeqObservation::Gap { start, end } => {
                ListenerStats::add(&self.shared.stats.gaps_detected, 1);
                match self.begin_replay(registry, start, end, (seq, frames)) {
                    Ok(()) => return,
                    Err(frames) => frames,
                }
            }
            _ => frames,
        };
        self.resume_live(seq, live_payload(&frames));
    }

    /// Applies a live batch unless a replay already covered it.
    fn resume_live(&mut self, seq: u64, payload: &[u8]) {
        if self.watermark.observe(seq) == SeqObservation::Stale {
            ListenerStats::add(&self.shared.stats.stale_batches, 1);
            if self.stale_log.allow() {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    seq,
                    watermark = ?self.watermark.last(),
                    occurrences = self.stale_log.count(),
                    "stale KV-event batch dropped (duplicate after replay, or the publisher restarted)"
                );
            }
            return;
        }
        self.apply(seq, payload);
    }

    fn drop_message(&mut self, reason: DropReason, err: &dyn std::fmt::Display) {
        self.shared.stats.count_drop(reason);
        let log = &mut self.drop_log[reason.index()];
        if log.allow() {
            tracing::warn!(
                worker_id = self.config.worker.worker_id.0,
                dp_rank = self.config.worker.dp_rank.0,
                reason = reason.as_str(),
                error = %err,
                occurrences = log.count(),
                "KV-event message dropped"
            );
        }
    }

    /// Decodes and normalizes one batch and holds it for the sink (see [`Self::flush`]);
    /// advances the watermark used for gap detection unless the payload failed to decode.
    /// The published watermark moves once the sink has the batch.
    fn apply(&mut self, seq: u64, payload: &[u8]) -> bool {
        let stats = Arc::clone(&self.shared.stats);
        let res = self.normalizer.process_payload_reusing(
            payload,
            seq,
            &mut self.ops,
            &mut self.spares.lock(),
            |r| stats.count_filter(r),
        );
        let truncated = self.normalizer.take_truncated();
        if let Err(e) = res {
            self.drop_message(DropReason::from(&e), &e);
            self.account(seq);
            return false;
        }
        // Counted before the sink sees the batch, so whoever sees it sees the counts.
        stats.count_truncated(truncated);
        self.pending.push((self.ops.len(), seq));
        self.watermark = Watermark::Live(seq);
        if self.pending.len() >= PENDING_BATCHES || self.ops.len() >= PENDING_OPS {
            self.flush();
        }
        true
    }

    /// Hands the held batches to the sink in one call, then counts them and publishes the
    /// watermark of the last one.
    fn flush(&mut self) {
        let Some(&(_, last)) = self.pending.last() else {
            return;
        };
        // Taken out first: if the sink panics, the listener fails (`read_guarded`) with
        // nothing held, so its `finish` does not hand the same batches over again.
        let mut ops = std::mem::take(&mut self.ops);
        let mut pending = std::mem::take(&mut self.pending);
        let blocks: usize = ops
            .iter()
            .map(|op| match &op.kind {
                KvOperationKind::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum();
        let count = ops.len();
        // The sink may keep `ops` and give back another vector, done with, to reuse.
        self.sink.apply_batches_owned(&mut ops, &pending);
        let stats = &self.shared.stats;
        ListenerStats::add(&stats.batches_applied, pending.len() as u64);
        ListenerStats::add(&stats.operations_applied, count as u64);
        ListenerStats::add(&stats.blocks_stored, blocks as u64);
        self.shared.watermark.store(last, Ordering::Release);
        self.spares.lock().recycle(&mut ops);
        pending.clear();
        self.ops = ops;
        self.pending = pending;
    }

    /// Counts the seqs of `[start, end)` not accounted for yet as lost; returns how many.
    fn count_lost(&mut self, start: u64, end: u64) -> u64 {
        let from = self
            .accounted
            .map_or(start, |a| start.max(a.saturating_add(1)));
        let lost = end.saturating_sub(from);
        ListenerStats::add(&self.shared.stats.batches_lost, lost);
        if end > start {
            self.account(end - 1);
        }
        lost
    }

    fn account(&mut self, seq: u64) {
        self.accounted = Some(self.accounted.map_or(seq, |a| a.max(seq)));
    }

    /// §10.3: asks the engine to replay from `start` (the batches `[start, end)` are
    /// missing) and holds the live batch until the replay is over. Without a replay
    /// endpoint the batches are lost (logged and counted); when the request cannot be sent
    /// the replay ends at once. Either way the live batch comes back to be applied now.
    fn begin_replay(
        &mut self,
        registry: &mio::Registry,
        start: u64,
        end: u64,
        held: (u64, Vec<zmq::Message>),
    ) -> Result<(), Vec<zmq::Message>> {
        if self.config.replay_endpoint.is_none() {
            let lost = self.count_lost(start, end);
            if lost > 0 && self.loss_log.allow() {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    start,
                    end,
                    lost,
                    occurrences = self.loss_log.count(),
                    "KV-event sequence gap and no replay endpoint: batches lost"
                );
            }
            return Err(held.1);
        }
        ListenerStats::add(&self.shared.stats.replays_requested, 1);
        let replay = Replay {
            start,
            end,
            from: self
                .accounted
                .map_or(start, |a| start.max(a.saturating_add(1))),
            taken: 0,
            // A timeout too large for the clock (an embedder's choice) waits a year.
            deadline: Instant::now()
                .checked_add(self.config.replay_timeout)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400)),
            first: None,
            last: None,
            contiguous: true,
            held,
        };
        let sent = match self.ensure_dealer(registry) {
            Ok(dealer) => dealer
                .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
                .map_err(|e| {
                    tracing::warn!(
                        worker_id = self.config.worker.worker_id.0,
                        dp_rank = self.config.worker.dp_rank.0,
                        error = %e,
                        "replay request could not be sent"
                    );
                }),
            Err(e) => {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    error = %e,
                    "cannot open the replay socket"
                );
                Err(())
            }
        };
        self.mode = Mode::Replaying(Box::new(replay));
        // A send can make the socket readable without an edge (module docs).
        self.dealer_ready = true;
        if sent.is_err() {
            let held = self.close_replay(registry, ReplayEnd::SendFailed);
            return Err(held.map(|(_, frames)| frames).unwrap_or_default());
        }
        Ok(())
    }

    /// One answer of the replay socket: `["", seq, payload]` (SGLang) or
    /// `["", topic, seq, payload]` (vLLM); an empty payload is the end marker.
    fn on_replayed(&mut self, registry: &mio::Registry, frames: &[zmq::Message], count: usize) {
        let (seq_frame, payload) = match (count, frames) {
            (3, [_, seq, payload]) => (seq, payload),
            (4, [_, _, seq, payload]) => (seq, payload),
            _ => return self.end_replay(registry, ReplayEnd::BadResponse),
        };
        let Ok(seq) = parse_seq(seq_frame) else {
            return self.end_replay(registry, ReplayEnd::BadResponse);
        };
        if payload.is_empty() {
            return self.end_replay(registry, ReplayEnd::Marker);
        }
        ListenerStats::add(&self.shared.stats.replayed_batches, 1);
        if let Mode::Replaying(r) = &mut self.mode {
            if r.first.is_none() {
                r.first = Some(seq);
            }
            if let Some(prev) = r.last
                && seq != prev.wrapping_add(1)
            {
                r.contiguous = false;
            }
            r.last = Some(seq);
        }
        // Deviation from the reference (which applies whatever comes): a replayed batch at
        // or below the watermark was already applied, so applying it again would only churn
        // the index.
        if self.watermark.observe(seq) == SeqObservation::Stale {
            return;
        }
        // Each seq once: an undecodable batch leaves the watermark below it, so a second
        // copy is not stale, but it was accounted for (dropped) the first time.
        if let Mode::Replaying(r) = &mut self.mode
            && (r.from..r.end).contains(&seq)
            && self.accounted.is_none_or(|a| seq > a)
        {
            r.taken += 1;
        }
        self.apply(seq, payload);
    }

    /// Ends the replay in progress and applies the live batch it held (unless stopping).
    fn end_replay(&mut self, registry: &mio::Registry, outcome: ReplayEnd) {
        if let Some((seq, frames)) = self.close_replay(registry, outcome)
            && outcome != ReplayEnd::Stopped
        {
            self.resume_live(seq, live_payload(&frames));
        }
    }

    /// Ends the replay in progress: counts and logs its outcome, closes the DEALER unless
    /// the replay finished cleanly, and returns the held live batch.
    fn close_replay(
        &mut self,
        registry: &mio::Registry,
        outcome: ReplayEnd,
    ) -> Option<(u64, Vec<zmq::Message>)> {
        let Mode::Replaying(r) = std::mem::replace(&mut self.mode, Mode::Live) else {
            return None;
        };
        // The SUB was not read during the replay: whatever queued there is read next.
        self.sub_ready = true;
        let Replay {
            start,
            end,
            from,
            taken,
            first,
            last,
            contiguous,
            held,
            ..
        } = *r;
        let stats = &self.shared.stats;
        let complete = outcome == ReplayEnd::Marker
            && first == Some(start)
            && contiguous
            && last.is_some_and(|l| l >= end - 1);
        if complete {
            ListenerStats::add(&stats.replays_complete, 1);
        } else {
            if outcome == ReplayEnd::TimedOut {
                ListenerStats::add(&stats.replays_timed_out, 1);
            } else {
                ListenerStats::add(&stats.replays_incomplete, 1);
            }
            let defect = match (first, last) {
                (None, _) => "empty",
                (Some(f), _) if f > start => "started_after_requested",
                _ if !contiguous => "non_contiguous",
                (_, Some(l)) if l < end - 1 => "ended_before_target",
                _ => "ended_abnormally",
            };
            // Every missing seq the replay did not bring: before its first batch, between
            // its batches and after its last (counting only the tail lost holes before and
            // between, which the later batches had moved past).
            let lost = end.saturating_sub(from).saturating_sub(taken);
            ListenerStats::add(&stats.batches_lost, lost);
            self.account(end - 1);
            if lost > 0 && self.loss_log.allow() {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    start,
                    end,
                    defect,
                    outcome = ?outcome,
                    lost,
                    occurrences = self.loss_log.count(),
                    "KV-event replay incomplete; live ingestion continues"
                );
            }
        }
        if outcome != ReplayEnd::Marker
            && let Some(dealer) = self.dealer.take()
        {
            // Late answers to an abandoned request must not be read as answers to the next.
            deregister(registry, &dealer);
            self.dealer_ready = false;
        }
        Some(held)
    }

    fn ensure_dealer(&mut self, registry: &mio::Registry) -> Result<&zmq::Socket, String> {
        let dealer = match self.dealer.take() {
            Some(d) => d,
            None => {
                let ep = self.config.replay_endpoint.clone().unwrap_or_default();
                let s = new_socket(&self.ctx, zmq::DEALER, &ep, self.config.max_message_size)
                    .map_err(|e| e.to_string())?;
                s.connect(&ep)
                    .map_err(|e| format!("zmq connect failed for {ep:?}: {e}"))?;
                register(registry, s.get_fd(), dealer_token(self.slot))?;
                s
            }
        };
        Ok(self.dealer.insert(dealer))
    }
}
