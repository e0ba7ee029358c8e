//! The ceiling `cargo xtask bench ingest` divides by: the same publisher process streaming
//! the same workload to subscribers that decode and apply nothing.
//!
//! These machines drift by a quarter and more between minutes, and from one host to the
//! next by more (a slower core, page faults that cost the hypervisor a fault of its own),
//! so a rate alone says little about a change or about the target. The null sink
//! moves the same bytes through the same ZMQ sockets on the same two cores, measured in
//! the same round as the server, so the server's rate over it compares across windows.
//! The sink runs in this (driver) process, which is neither the publisher nor the server.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::ingest_workload::{PUBS_PER_CONTEXT, Publisher, Workload};

/// How long one round of probes waits for seq 0 to arrive before sending it again.
const PROBE_WAIT: Duration = Duration::from_millis(50);

/// Streams `w` from a fresh publisher process into subscribers that only count, and
/// returns the time from `go` to the last batch received.
pub(crate) fn null_sink(w: &Workload) -> Result<Duration> {
    let mut publisher = Publisher::start(w)?;
    // One SUB socket per worker, in contexts of as many as the publisher's (libzmq caps a
    // context at 1,023 sockets).
    let contexts: Vec<zmq::Context> = (0..w.workers.div_ceil(PUBS_PER_CONTEXT))
        .map(|_| zmq::Context::new())
        .collect();
    let mut sockets = Vec::with_capacity(publisher.endpoints.len());
    for (i, endpoint) in publisher.endpoints.iter().enumerate() {
        let s = contexts[i / PUBS_PER_CONTEXT as usize].socket(zmq::SUB)?;
        s.set_linger(0)?;
        s.set_subscribe(b"")?;
        s.connect(endpoint)
            .with_context(|| format!("null sink: connecting to {endpoint}"))?;
        sockets.push(s);
    }
    let mut sink = Sink::new(sockets);

    // Seq 0 until every subscription has landed: a PUB drops what it sends before.
    let waited = Instant::now();
    while sink.landed < sink.sockets.len() {
        ensure!(
            waited.elapsed() < Duration::from_secs(60),
            "null sink: {} of {} subscriptions landed within 60 s",
            sink.landed,
            sink.sockets.len()
        );
        publisher.command("probe")?;
        ensure!(
            publisher.line()? == "ok",
            "the publisher did not acknowledge the probe"
        );
        let until = Instant::now() + PROBE_WAIT;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            sink.receive(left)?;
        }
    }

    // Seq 1 and on (the server's count of applied batches includes the seq 0 it probed).
    let expected = w.workers * w.batches_per_worker();
    let go = Instant::now();
    publisher.command("go")?;
    let deadline = go + Duration::from_secs(120);
    while sink.batches < expected {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            bail!(
                "null sink: {} of {expected} batches after 120 s",
                sink.batches
            );
        };
        sink.receive(left)?;
    }
    let received_in = go.elapsed();
    let done = publisher.line()?;
    ensure!(
        done.starts_with("done "),
        "unexpected publisher answer {done:?}"
    );
    Ok(received_in)
}

/// The subscribers and what they received.
struct Sink {
    sockets: Vec<zmq::Socket>,
    /// Per socket: whether seq 0 arrived.
    probed: Vec<bool>,
    landed: usize,
    /// Batches of seq 1 and on (a late probe's seq 0 is not counted).
    batches: u64,
    frame: zmq::Message,
    /// The sockets a poll found readable (kept, so a poll allocates only its items).
    ready: Vec<usize>,
}

impl Sink {
    fn new(sockets: Vec<zmq::Socket>) -> Self {
        Sink {
            probed: vec![false; sockets.len()],
            sockets,
            landed: 0,
            batches: 0,
            frame: zmq::Message::new(),
            ready: Vec::new(),
        }
    }

    /// Waits at most `timeout` for a socket to be readable, then takes every batch that
    /// waits on every socket.
    fn receive(&mut self, timeout: Duration) -> Result<()> {
        let mut items: Vec<zmq::PollItem<'_>> = self
            .sockets
            .iter()
            .map(|s| s.as_poll_item(zmq::POLLIN))
            .collect();
        let ms = i64::try_from(timeout.as_millis().max(1)).unwrap_or(i64::MAX);
        if zmq::poll(&mut items, ms)? == 0 {
            return Ok(());
        }
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        ready.extend(
            items
                .iter()
                .enumerate()
                .filter(|(_, item)| item.is_readable())
                .map(|(i, _)| i),
        );
        drop(items);
        for &i in &ready {
            while let Some(seq) = self.batch(i)? {
                if seq > 0 {
                    self.batches += 1;
                } else if !self.probed[i] {
                    self.probed[i] = true;
                    self.landed += 1;
                }
            }
        }
        self.ready = ready;
        Ok(())
    }

    /// The seq of the next batch waiting on socket `i`, its frames taken and dropped;
    /// `None` when none waits.
    fn batch(&mut self, i: usize) -> Result<Option<u64>> {
        let s = &self.sockets[i];
        match s.recv(&mut self.frame, zmq::DONTWAIT) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        // A multipart message arrives whole: topic, seq, payload.
        let mut frames = 1;
        let mut seq = None;
        while s.get_rcvmore()? {
            s.recv(&mut self.frame, 0)?;
            frames += 1;
            if frames == 2 {
                seq = <[u8; 8]>::try_from(&self.frame[..])
                    .ok()
                    .map(u64::from_be_bytes);
            }
        }
        match (frames, seq) {
            (3, Some(seq)) => Ok(Some(seq)),
            _ => bail!("null sink: a message of {frames} frames without an 8-byte seq"),
        }
    }
}
