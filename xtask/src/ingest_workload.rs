//! The workload of `cargo xtask bench ingest` and the publisher process that streams it.
//!
//! Everything here is a pure function of [`Workload`], so the driver knows, without being
//! told, every hash and token the publisher sends: it computes the expected index size and
//! builds the prompts of its probes from the same functions.
//!
//! Per worker `w` (one ZMQ PUB each, one DP rank), batch seq 1 stores [`SHARED_PREFIXES`]
//! chains of [`PREFIX_BLOCKS`] blocks whose tokens and engine hashes are the same on every
//! worker (a system prompt every engine holds). Seqs `2..=batches+1` each carry `events`
//! `BlockStored` events of `blocks` fresh blocks; a `shared` fraction of the events hangs its
//! chain below one of the prefixes (`parent_block_hash` = the prefix's last hash), the others
//! start at the root. Tokens come from a counter through splitmix64, so no two blocks share
//! their tokens and every run streams the same bytes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

/// Prefix chains shared by every worker.
pub(crate) const SHARED_PREFIXES: u64 = 4;
/// Blocks of each shared prefix.
pub(crate) const PREFIX_BLOCKS: u64 = 8;
/// Tokens per block (the block size every worker registers).
pub(crate) const BLOCK_SIZE: u64 = 16;
/// PUB sockets per ZMQ context of the publisher (libzmq caps a context at 1,023 sockets).
pub(crate) const PUBS_PER_CONTEXT: u64 = 1_000;
/// Token ids stay below a realistic vocabulary size, so they encode as msgpack does them
/// from an engine (2- and 4-byte integers).
const VOCABULARY: u64 = 128_000;

/// The shape of one run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Workload {
    pub(crate) workers: u64,
    pub(crate) batches: u64,
    pub(crate) events: u64,
    pub(crate) blocks: u64,
    /// Fraction of the events whose chain hangs below a shared prefix.
    pub(crate) shared: f64,
    /// Blocks each worker declares it can hold (`total_kv_blocks`; `None`:
    /// [`DEFAULT_CAPACITY`]). Below what a worker stores, the index evicts its oldest
    /// blocks as new ones come (#24 item 4), so the stream runs at a steady index size, as
    /// against a server whose engines are full, instead of growing it.
    pub(crate) capacity: Option<u64>,
    /// Workload events each worker keeps (`None`: all): the batch that stores event `g`
    /// also removes event `g - retain` (one `BlockRemoved` of its blocks, leaf first), as
    /// an engine that evicts its oldest blocks reports them, so the index stays at a steady
    /// size through removal events.
    pub(crate) retain: Option<u64>,
}

/// `total_kv_blocks` each worker declares without `--capacity-blocks`: four times what the
/// default workload stores per worker.
pub(crate) const DEFAULT_CAPACITY: u64 = 1_000_000;

/// Where one event's chain starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parent {
    Root,
    /// Below the last block of shared prefix `p`.
    Prefix(u64),
}

impl Workload {
    pub(crate) fn validate(&self) -> Result<()> {
        ensure!(self.workers > 0, "--workers must be at least 1");
        ensure!(self.batches > 0, "--batches must be at least 1");
        ensure!(self.events > 0, "--events must be at least 1");
        ensure!(self.blocks > 0, "--blocks must be at least 1");
        ensure!(
            (0.0..=1.0).contains(&self.shared),
            "--shared must be between 0 and 1"
        );
        ensure!(
            self.workers < 1 << 20 && self.batches * self.events * self.blocks < 1 << 36,
            "the workload is too large for the bench's hash layout"
        );
        if let Some(r) = self.retain {
            // The probes look up each worker's last chains below a prefix and from the
            // root, which lie in its last batch.
            ensure!(
                r >= self.events,
                "--retain-events must be at least --events ({})",
                self.events
            );
            ensure!(
                self.capacity.is_none(),
                "--retain-events and --capacity-blocks do not combine"
            );
        }
        // The probes look up each worker's last chains below a prefix and from the root:
        // the prefixes and a few batches must fit.
        let least = SHARED_PREFIXES * PREFIX_BLOCKS + 4 * self.events * self.blocks;
        ensure!(
            self.declared_capacity() >= least,
            "--capacity-blocks must be at least {least} (the shared prefixes and four batches)"
        );
        Ok(())
    }

    /// The flags of `bench ingest` that give a child process (the publisher, the index
    /// floor) this workload.
    pub(crate) fn child_args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            ("--workers", self.workers.to_string()),
            ("--batches", self.batches.to_string()),
            ("--events", self.events.to_string()),
            ("--blocks", self.blocks.to_string()),
            ("--shared", self.shared.to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect();
        if let Some(c) = self.capacity {
            args.extend(["--capacity-blocks".to_owned(), c.to_string()]);
        }
        if let Some(r) = self.retain {
            args.extend(["--retain-events".to_owned(), r.to_string()]);
        }
        args
    }

    /// The `total_kv_blocks` each worker declares.
    pub(crate) fn declared_capacity(&self) -> u64 {
        self.capacity.unwrap_or(DEFAULT_CAPACITY)
    }

    /// Blocks the workload batches store (the prefix batch not included).
    pub(crate) fn stream_blocks(&self) -> u64 {
        self.workers * self.batches * self.events * self.blocks
    }

    /// Workload events per worker.
    fn events_per_worker(&self) -> u64 {
        self.batches * self.events
    }

    /// Workload events each worker still holds at the end (the rest it removed).
    fn kept_events(&self) -> u64 {
        let all = self.events_per_worker();
        self.retain.map_or(all, |r| r.min(all))
    }

    /// The event whose blocks the batch storing workload event `g` removes, if any.
    pub(crate) fn removed_with(&self, g: u64) -> Option<u64> {
        self.retain.and_then(|r| g.checked_sub(r))
    }

    /// `BlockRemoved` events the workload sends.
    pub(crate) fn removed_events(&self) -> u64 {
        self.workers * (self.events_per_worker() - self.kept_events())
    }

    /// Device blocks each worker holds once everything is applied, before its capacity.
    pub(crate) fn held_per_worker(&self) -> u64 {
        SHARED_PREFIXES * PREFIX_BLOCKS + self.kept_events() * self.blocks
    }

    /// Device memberships once everything is applied: what each worker holds, or its
    /// capacity if that is less.
    pub(crate) fn memberships(&self) -> u64 {
        self.workers * self.held_per_worker().min(self.declared_capacity())
    }

    /// Blocks the index evicts for the workers' capacities.
    pub(crate) fn evictions(&self) -> u64 {
        self.workers * self.held_per_worker() - self.memberships()
    }

    /// Distinct device blocks (trie nodes) once everything is applied without evictions.
    pub(crate) fn nodes(&self) -> u64 {
        SHARED_PREFIXES * PREFIX_BLOCKS + self.workers * self.kept_events() * self.blocks
    }

    /// Stored events the index accepts: the prefixes and every workload event.
    pub(crate) fn stored_events(&self) -> u64 {
        self.workers * (SHARED_PREFIXES + self.batches * self.events)
    }

    /// Batches each listener applies: the prefix batch and the workload (the probe of seq 0
    /// not included).
    pub(crate) fn batches_per_worker(&self) -> u64 {
        self.batches + 1
    }

    /// The parent of workload event `g` (counted over the worker's batches): exactly a
    /// `shared` fraction of every run of events hangs below a prefix, spread evenly.
    pub(crate) fn parent(&self, g: u64) -> Parent {
        let below = |n: u64| (n as f64 * self.shared).floor() as u64;
        if below(g + 1) > below(g) {
            Parent::Prefix(g % SHARED_PREFIXES)
        } else {
            Parent::Root
        }
    }

    /// Engine hash of block `b` of workload event `g` of worker `w`.
    pub(crate) fn block_hash(&self, w: u64, g: u64, b: u64) -> u64 {
        ((w + 1) << 40) | (g * self.blocks + b)
    }

    /// Token `i` of block `b` of workload event `g` of worker `w`.
    pub(crate) fn token(&self, w: u64, g: u64, b: u64, i: u64) -> u32 {
        mix((((w + 1) << 40 | (g * self.blocks + b)) * BLOCK_SIZE) + i)
    }

    /// The tokens of workload event `g` of worker `w`, all its blocks.
    pub(crate) fn event_tokens(&self, w: u64, g: u64) -> Vec<u32> {
        (0..self.blocks)
            .flat_map(|b| (0..BLOCK_SIZE).map(move |i| (b, i)))
            .map(|(b, i)| self.token(w, g, b, i))
            .collect()
    }

    /// The encoded batch of seq `seq` of worker `w` (seq 1: the prefixes).
    pub(crate) fn batch(&self, w: u64, seq: u64) -> Result<Vec<u8>> {
        let mut out =
            Vec::with_capacity((self.events * self.blocks * BLOCK_SIZE * 3 + 256) as usize);
        if seq == 1 {
            begin_batch(&mut out, SHARED_PREFIXES)?;
            for p in 0..SHARED_PREFIXES {
                let hashes: Vec<u64> = (0..PREFIX_BLOCKS).map(|b| prefix_hash(p, b)).collect();
                write_stored(&mut out, &hashes, None, &prefix_tokens(p))?;
            }
        } else {
            let j = seq - 2;
            let first = j * self.events;
            let removals = (first..first + self.events)
                .filter(|&g| self.removed_with(g).is_some())
                .count() as u64;
            begin_batch(&mut out, self.events + removals)?;
            let mut hashes = Vec::with_capacity(self.blocks as usize);
            for g in first..first + self.events {
                hashes.clear();
                hashes.extend((0..self.blocks).map(|b| self.block_hash(w, g, b)));
                let parent = match self.parent(g) {
                    Parent::Root => None,
                    Parent::Prefix(p) => Some(prefix_hash(p, PREFIX_BLOCKS - 1)),
                };
                write_stored(&mut out, &hashes, parent, &self.event_tokens(w, g))?;
                if let Some(old) = self.removed_with(g) {
                    hashes.clear();
                    hashes.extend((0..self.blocks).rev().map(|b| self.block_hash(w, old, b)));
                    write_removed(&mut out, &hashes)?;
                }
            }
        }
        rmp::encode::write_nil(&mut out)?;
        Ok(out)
    }
}

/// Engine hash of block `b` of shared prefix `p` (the same on every worker).
pub(crate) fn prefix_hash(p: u64, b: u64) -> u64 {
    (1 << 63) | (p << 16) | b
}

/// The tokens of shared prefix `p`.
pub(crate) fn prefix_tokens(p: u64) -> Vec<u32> {
    (0..PREFIX_BLOCKS * BLOCK_SIZE)
        .map(|i| mix((1 << 62) | (p << 20) | i))
        .collect()
}

/// splitmix64 of `x`, reduced to a token id.
fn mix(x: u64) -> u32 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % VOCABULARY) as u32
}

/// `[ts, [` of a batch with `events` events.
fn begin_batch(out: &mut Vec<u8>, events: u64) -> Result<()> {
    rmp::encode::write_array_len(out, 3)?;
    rmp::encode::write_f64(out, 0.0)?;
    rmp::encode::write_array_len(out, u32::try_from(events).context("too many events")?)?;
    Ok(())
}

/// `["BlockStored", hashes, parent, tokens, block_size]`, vLLM's positional form.
fn write_stored(
    out: &mut Vec<u8>,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
) -> Result<()> {
    use rmp::encode::{write_array_len, write_nil, write_str, write_uint};
    let len = |n: usize| u32::try_from(n).context("array too long");
    write_array_len(out, 5)?;
    write_str(out, "BlockStored")?;
    write_array_len(out, len(hashes.len())?)?;
    for &h in hashes {
        write_uint(out, h)?;
    }
    match parent {
        Some(p) => {
            write_uint(out, p)?;
        }
        None => write_nil(out)?,
    }
    write_array_len(out, len(tokens.len())?)?;
    for &t in tokens {
        write_uint(out, u64::from(t))?;
    }
    write_uint(out, BLOCK_SIZE)?;
    Ok(())
}

/// `["BlockRemoved", hashes]`, vLLM's positional form without a medium.
fn write_removed(out: &mut Vec<u8>, hashes: &[u64]) -> Result<()> {
    use rmp::encode::{write_array_len, write_str, write_uint};
    write_array_len(out, 2)?;
    write_str(out, "BlockRemoved")?;
    write_array_len(out, u32::try_from(hashes.len()).context("array too long")?)?;
    for &h in hashes {
        write_uint(out, h)?;
    }
    Ok(())
}

/// `[0.0, [], nil]`: seq 0 of every stream, resent until every subscription has landed.
fn empty_batch() -> Result<Vec<u8>> {
    let mut out = Vec::new();
    begin_batch(&mut out, 0)?;
    rmp::encode::write_nil(&mut out)?;
    Ok(out)
}

/// The publisher process (`bench ingest --publish`): binds one PUB per worker, encodes the
/// whole workload, prints one endpoint per line then `ready`, and obeys stdin: `probe`
/// sends seq 0 on every socket, `probe ID...` on those workers' only (both answered `ok`),
/// `go` streams every batch, round-robin over
/// the workers, and answers `done <seconds>`. It exits when stdin closes: a PUB with linger
/// 0 would drop whatever the server has not read yet.
///
/// The sockets are spread over contexts of [`PUBS_PER_CONTEXT`]: libzmq refuses a context's
/// 1,024th socket (`ZMQ_MAX_SOCKETS`, which the `zmq` crate cannot raise) with EMFILE, so a
/// single context failed every run past 1,023 workers with "Too many open files".
pub(crate) fn publish(w: &Workload) -> Result<()> {
    w.validate()?;
    let contexts: Vec<zmq::Context> = (0..w.workers.div_ceil(PUBS_PER_CONTEXT))
        .map(|_| zmq::Context::new())
        .collect();
    let mut sockets = Vec::with_capacity(w.workers as usize);
    let mut stdout = std::io::stdout().lock();
    for i in 0..w.workers {
        let s = contexts[(i / PUBS_PER_CONTEXT) as usize]
            .socket(zmq::PUB)
            .with_context(|| format!("creating the PUB socket of worker {i}"))?;
        s.set_linger(0)?;
        // Unbounded: PUB drops at its high-water mark, and the bench must lose nothing.
        s.set_sndhwm(0)?;
        s.bind("tcp://127.0.0.1:*")?;
        let endpoint = s
            .get_last_endpoint()?
            .map_err(|_| anyhow::anyhow!("non-UTF-8 endpoint"))?;
        writeln!(stdout, "{endpoint}")?;
        sockets.push(s);
    }
    // Encoded ahead, so the stream costs the publisher only its sends.
    let mut batches: Vec<Vec<zmq::Message>> = Vec::with_capacity(w.batches as usize + 1);
    for seq in 1..=w.batches + 1 {
        batches.push(
            (0..w.workers)
                .map(|wk| w.batch(wk, seq).map(zmq::Message::from))
                .collect::<Result<_>>()?,
        );
    }
    writeln!(stdout, "ready")?;
    stdout.flush()?;
    let empty = empty_batch()?;
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line?;
        match line.trim() {
            probe if probe == "probe" || probe.starts_with("probe ") => {
                let ids: Vec<&str> = probe.split_ascii_whitespace().skip(1).collect();
                let targets: Vec<&zmq::Socket> = if ids.is_empty() {
                    sockets.iter().collect()
                } else {
                    ids.iter()
                        .map(|id| {
                            id.parse::<usize>()
                                .ok()
                                .and_then(|i| sockets.get(i))
                                .with_context(|| format!("publisher: no worker {id:?} to probe"))
                        })
                        .collect::<Result<_>>()?
                };
                for s in targets {
                    s.send_multipart([&b""[..], &0u64.to_be_bytes()[..], &empty[..]], 0)?;
                }
                writeln!(stdout, "ok")?;
            }
            "go" => {
                let started = std::time::Instant::now();
                for (j, row) in std::mem::take(&mut batches).into_iter().enumerate() {
                    let seq = (j + 1) as u64;
                    for (s, payload) in sockets.iter().zip(row) {
                        s.send(&b""[..], zmq::SNDMORE)?;
                        s.send(&seq.to_be_bytes()[..], zmq::SNDMORE)?;
                        s.send(payload, 0)?;
                    }
                }
                writeln!(stdout, "done {}", started.elapsed().as_secs_f64())?;
            }
            other => bail!("publisher: unknown command {other:?}"),
        }
        stdout.flush()?;
    }
    Ok(())
}

/// The publisher child process and its command pipe; killed when dropped.
#[derive(Debug)]
pub(crate) struct Publisher {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub(crate) endpoints: Vec<String>,
}

impl Publisher {
    pub(crate) fn start(w: &Workload) -> Result<Self> {
        let exe = std::env::current_exe().context("cannot locate the running xtask")?;
        let mut child = Command::new(exe)
            .args(["bench", "ingest", "--publish"])
            .args(w.child_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("failed to start the publisher process")?;
        let stdin = child.stdin.take().context("publisher stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("publisher stdout")?);
        let mut p = Self {
            child,
            stdin: Some(stdin),
            stdout,
            endpoints: Vec::new(),
        };
        let started = Instant::now();
        loop {
            let line = p.line()?;
            if line == "ready" {
                break;
            }
            p.endpoints.push(line);
        }
        ensure!(
            p.endpoints.len() as u64 == w.workers,
            "the publisher bound {} sockets, expected {}",
            p.endpoints.len(),
            w.workers
        );
        eprintln!(
            "xtask bench ingest: publisher pid {} encoded the workload in {:.1?}",
            p.child.id(),
            started.elapsed()
        );
        Ok(p)
    }

    pub(crate) fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line)?;
        if n == 0 {
            let status = self.child.wait()?;
            bail!("the publisher exited ({status})");
        }
        Ok(line.trim().to_owned())
    }

    pub(crate) fn command(&mut self, cmd: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("publisher stdin closed")?;
        writeln!(stdin, "{cmd}")?;
        stdin.flush()?;
        Ok(())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Workload {
        Workload {
            workers: 2,
            batches: 3,
            events: 6,
            blocks: 4,
            shared: 1.0 / 3.0,
            capacity: None,
            retain: None,
        }
    }

    #[test]
    fn a_third_of_the_events_hang_below_the_prefixes_in_turn() {
        let w = small();
        let parents: Vec<Parent> = (0..6).map(|g| w.parent(g)).collect();
        let shared = parents.iter().filter(|p| **p != Parent::Root).count();
        assert_eq!(shared, 2);
        let none = Workload { shared: 0.0, ..w };
        assert!((0..100).all(|g| none.parent(g) == Parent::Root));
        let all = Workload { shared: 1.0, ..w };
        assert_eq!(all.parent(5), Parent::Prefix(5 % SHARED_PREFIXES));
    }

    #[test]
    fn batches_carry_the_events_hashes_parents_and_tokens() {
        let w = small();
        let prefixes: rmpv::Value =
            rmpv::decode::read_value(&mut &w.batch(0, 1).unwrap()[..]).unwrap();
        assert_eq!(
            prefixes[1].as_array().unwrap().len(),
            SHARED_PREFIXES as usize
        );
        let b: rmpv::Value = rmpv::decode::read_value(&mut &w.batch(1, 3).unwrap()[..]).unwrap();
        let events = b[1].as_array().unwrap();
        assert_eq!(events.len(), 6);
        // Seq 3 is workload batch 1: events g = 6..12.
        let e = &events[2];
        assert_eq!(e[0].as_str(), Some("BlockStored"));
        assert_eq!(e[1][0].as_u64(), Some(w.block_hash(1, 8, 0)));
        let parent = match w.parent(8) {
            Parent::Root => None,
            Parent::Prefix(p) => Some(prefix_hash(p, PREFIX_BLOCKS - 1)),
        };
        assert_eq!(e[2].as_u64(), parent);
        let tokens: Vec<u32> = e[3]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tokens, w.event_tokens(1, 8));
        assert_eq!(tokens.len() as u64, w.blocks * BLOCK_SIZE);
        assert!(b[2].is_nil());
    }

    #[test]
    fn totals_count_prefixes_once_per_worker_and_blocks_once_per_node() {
        let w = small();
        assert_eq!(w.stream_blocks(), 2 * 3 * 6 * 4);
        assert_eq!(w.nodes(), 32 + 144);
        assert_eq!(w.memberships(), 2 * (32 + 72));
        assert_eq!(w.stored_events(), 2 * (4 + 18));
        assert!(Workload { workers: 0, ..w }.validate().is_err());
        assert!(Workload { shared: 1.5, ..w }.validate().is_err());
        assert_ne!(w.token(0, 0, 0, 0), w.token(1, 0, 0, 0));
        assert_eq!(w.evictions(), 0);
    }

    #[test]
    fn a_capacity_below_the_stored_blocks_keeps_it_per_worker_and_evicts_the_rest() {
        let w = small();
        assert_eq!(w.held_per_worker(), 32 + 72);
        // The prefixes and four batches of 6 events of 4 blocks: 32 + 96.
        let at_least = Workload {
            capacity: Some(128),
            ..w
        };
        assert!(at_least.validate().is_ok());
        assert_eq!(
            at_least.memberships(),
            2 * 104,
            "a capacity above what is stored"
        );
        assert_eq!(at_least.evictions(), 0);
        let big = Workload {
            blocks: 8,
            capacity: Some(32 + 4 * 6 * 8),
            ..w
        };
        assert!(big.validate().is_ok());
        assert_eq!(big.held_per_worker(), 32 + 3 * 6 * 8);
        assert_eq!(big.memberships(), 2 * (32 + 3 * 6 * 8));
        let bound = Workload {
            batches: 10,
            capacity: Some(128),
            ..w
        };
        assert_eq!(bound.memberships(), 2 * 128);
        assert_eq!(bound.evictions(), 2 * (32 + 10 * 6 * 4 - 128));
        assert!(
            Workload {
                capacity: Some(127),
                ..w
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn retained_events_remove_the_older_ones_in_the_batch_that_stores_past_them() {
        let w = Workload {
            retain: Some(8),
            ..small()
        };
        assert!(w.validate().is_ok());
        // 18 events per worker, 8 kept: events 0..10 removed, each with event g + 8.
        assert_eq!((w.removed_with(7), w.removed_with(8)), (None, Some(0)));
        assert_eq!(w.removed_events(), 2 * 10);
        assert_eq!(w.memberships(), 2 * (32 + 8 * 4));
        assert_eq!(w.nodes(), 32 + 2 * 8 * 4);
        assert_eq!(w.evictions(), 0);
        // Seq 3 (workload batch 1, events 6..12) stores 6 and removes 4 (events 0..4).
        let b: rmpv::Value = rmpv::decode::read_value(&mut &w.batch(1, 3).unwrap()[..]).unwrap();
        let events = b[1].as_array().unwrap();
        assert_eq!(events.len(), 10);
        let tags: Vec<&str> = events.iter().map(|e| e[0].as_str().unwrap()).collect();
        assert_eq!(
            &tags[..5],
            [
                "BlockStored",
                "BlockStored",
                "BlockStored",
                "BlockRemoved",
                "BlockStored"
            ]
        );
        // Event 8's entry is followed by the removal of event 0, leaf first.
        let removed: Vec<u64> = events[3][1]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        let want: Vec<u64> = (0..4).rev().map(|b| w.block_hash(1, 0, b)).collect();
        assert_eq!(removed, want);
        let short = Workload {
            retain: Some(5),
            ..small()
        };
        assert!(short.validate().is_err());
        let both = Workload {
            retain: Some(8),
            capacity: Some(1_000),
            ..small()
        };
        assert!(both.validate().is_err());
    }
}
