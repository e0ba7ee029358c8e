//! The admission queue of `scheduling.md` §5: policy classes, busy thresholds, ordering
//! within a class, deficit round robin between classes, and limit rejections.
//!
//! Sans-IO: the caller owns the clock (`now`), the load state (a gate closure that answers
//! "does this request have a non-busy eligible rank for this class?") and the re-check
//! triggers (call [`AdmissionQueue::next_ready`] in a loop after every capacity change and
//! on the periodic tick, booking each request it returns before asking for the next).

use std::fmt;
use std::time::{Duration, Instant};

use kv_types::WorkerKey;

use crate::config::{QueuePolicy, RouterConfig};
use crate::policy::DEFAULT_PREFILL_TOKEN_CAPACITY;

/// Periodic re-check of queued requests (`router_queue_recheck_interval`).
pub const QUEUE_RECHECK_INTERVAL: Duration = Duration::from_secs(60);
/// Periodic re-check when a prefill-duration model is enabled and queueing is configured.
pub const QUEUE_RECHECK_INTERVAL_WITH_MODEL: Duration = Duration::from_millis(100);
/// Default wait after which a dequeued request's overlap is looked up again
/// (`DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS`).
pub const DEFAULT_OVERLAP_REFRESH_AFTER: Duration = Duration::from_secs(10);

/// A policy class (the synthetic `"default"` one, or one of a policy file).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyClass {
    pub name: String,
    pub queue_policy: QueuePolicy,
    /// Deficit added per round-robin round; must be > 0.
    pub quantum: u64,
    /// Absolute active prefill tokens above which a rank is busy.
    pub prefill_busy_threshold: Option<u64>,
    /// Fraction of `max_num_batched_tokens` above which a rank is busy.
    pub prefill_busy_threshold_frac: Option<f64>,
    pub request_queue_limit_per_worker: Option<u64>,
    pub raw_isl_token_queue_limit_per_worker: Option<u64>,
    pub cached_token_queue_limit_per_worker: Option<u64>,
}

impl PolicyClass {
    /// The class used without a policy file: `router_queue_policy`, threshold fraction
    /// `router_queue_threshold`, quantum 1, no limits.
    pub fn synthetic(config: &RouterConfig) -> Self {
        Self {
            name: "default".to_owned(),
            queue_policy: config.router_queue_policy,
            quantum: 1,
            prefill_busy_threshold: None,
            prefill_busy_threshold_frac: config.router_queue_threshold,
            request_queue_limit_per_worker: None,
            raw_isl_token_queue_limit_per_worker: None,
            cached_token_queue_limit_per_worker: None,
        }
    }

    /// Queueing is enabled iff at least one busy threshold is set.
    pub fn queueing_enabled(&self) -> bool {
        self.prefill_busy_threshold.is_some() || self.prefill_busy_threshold_frac.is_some()
    }

    /// Whether a rank with `active_prefill_tokens` (not counting the incoming request) is
    /// busy for this class; `max_num_batched_tokens` defaults to 10 000 000.
    pub fn is_busy(&self, active_prefill_tokens: u64, max_num_batched_tokens: Option<u64>) -> bool {
        if let Some(t) = self.prefill_busy_threshold
            && active_prefill_tokens > t
        {
            return true;
        }
        self.prefill_busy_threshold_frac.is_some_and(|f| {
            let cap = max_num_batched_tokens.unwrap_or(DEFAULT_PREFILL_TOKEN_CAPACITY);
            active_prefill_tokens as f64 > f * cap as f64
        })
    }

    /// `quantum > 0` and a finite, non-negative `prefill_busy_threshold_frac`.
    pub fn validate(&self) -> Result<(), QueueConfigError> {
        if self.quantum == 0 {
            return Err(QueueConfigError::ZeroQuantum {
                class: self.name.clone(),
            });
        }
        if let Some(f) = self.prefill_busy_threshold_frac
            && !(f.is_finite() && f >= 0.0)
        {
            return Err(QueueConfigError::BadThreshold {
                class: self.name.clone(),
            });
        }
        Ok(())
    }

    fn has_zero_limit(&self) -> bool {
        [
            self.request_queue_limit_per_worker,
            self.raw_isl_token_queue_limit_per_worker,
            self.cached_token_queue_limit_per_worker,
        ]
        .contains(&Some(0))
    }
}

/// Which per-worker queue limit rejected a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    RawIslTokens,
    CachedTokens,
}

impl LimitKind {
    /// The wire spelling of `limit_kind`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::RawIslTokens => "raw_isl_tokens",
            Self::CachedTokens => "cached_tokens",
        }
    }
}

impl fmt::Display for LimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request refused by a class queue limit (429 with these four details).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "router policy class \"{policy_class}\" queue {limit_kind} limit reached (current={current}, limit={limit})"
)]
pub struct QueueRejected {
    pub policy_class: String,
    pub limit_kind: LimitKind,
    pub current: u64,
    /// `L · N`: the per-worker limit times the registered workers.
    pub limit: u64,
}

/// Misconfigured classes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QueueConfigError {
    #[error("at least one policy class is required")]
    NoClasses,
    #[error("policy class \"{class}\": quantum must be greater than 0")]
    ZeroQuantum { class: String },
    #[error(
        "policy class \"{class}\": prefill_busy_threshold_frac must be finite and non-negative"
    )]
    BadThreshold { class: String },
    #[error("policy class name must not be empty")]
    EmptyName,
    #[error("policy class \"{class}\" is defined twice")]
    DuplicateClass { class: String },
    #[error(
        "policy class \"{class}\": queue_policy lcfs is not allowed in a policy file (use fcfs or wspt)"
    )]
    LcfsInPolicyFile { class: String },
    #[error(
        "policy class \"{class}\": min_uncached_isl ({min}) must be less than max_uncached_isl ({max})"
    )]
    EmptyIslBucket { class: String, min: u64, max: u64 },
    #[error(
        "policy class \"{class}\": family \"{family}\" is already a class name or another class's family"
    )]
    DuplicateFamily { class: String, family: String },
    #[error("default_class \"{class}\" is not a defined policy class")]
    UnknownDefaultClass { class: String },
}

impl QueueConfigError {
    /// The configuration field at fault, as spelled in a policy file.
    pub fn field(&self) -> &'static str {
        match self {
            Self::NoClasses => "classes",
            Self::ZeroQuantum { .. } => "quantum",
            Self::BadThreshold { .. } => "prefill_busy_threshold_frac",
            Self::EmptyName | Self::DuplicateClass { .. } => "name",
            Self::LcfsInPolicyFile { .. } => "queue_policy",
            Self::EmptyIslBucket { .. } => "min_uncached_isl",
            Self::DuplicateFamily { .. } => "families",
            Self::UnknownDefaultClass { .. } => "default_class",
        }
    }
}

/// One request offered to the queue.
#[derive(Debug, Clone)]
pub struct Arrival<T> {
    pub payload: T,
    /// Index of the request's class (see [`AdmissionQueue::class_index`]).
    pub class: usize,
    pub isl: u64,
    /// Best `cached_tokens` among the allowed candidates (pinned: the pinned rank's).
    pub best_cached_tokens: u64,
    pub priority_jump: f64,
    pub strict_priority: u32,
    pub pinned: Option<WorkerKey>,
    /// Advisory selections bypass the queue and its limits.
    pub advisory: bool,
}

/// A request as the gate sees it.
#[derive(Debug, Clone)]
pub struct Waiting<T> {
    pub payload: T,
    pub isl: u64,
    pub best_cached_tokens: u64,
    pub pinned: Option<WorkerKey>,
    pub strict_priority: u32,
    score: f64,
    seq: u64,
}

impl<T> Waiting<T> {
    /// `isl − min(isl, best_cached_tokens)`.
    pub fn uncached_tokens(&self) -> u64 {
        self.isl - self.isl.min(self.best_cached_tokens)
    }

    fn ranks_before(&self, other: &Self) -> bool {
        // Higher (strict_priority, score) first; equal keys in enqueue order.
        match self.strict_priority.cmp(&other.strict_priority) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Less => false,
            std::cmp::Ordering::Equal => match self.score.total_cmp(&other.score) {
                std::cmp::Ordering::Greater => true,
                std::cmp::Ordering::Less => false,
                std::cmp::Ordering::Equal => self.seq < other.seq,
            },
        }
    }
}

/// What happened to an offered request.
#[derive(Debug)]
pub enum Offer<T> {
    /// Dispatch now (select among all eligible candidates and book).
    Admit(T),
    /// Waiting; it comes back from [`AdmissionQueue::next_ready`].
    Queued,
}

/// What [`AdmissionQueue::try_offer`] did.
#[derive(Debug)]
pub enum TryOffer<T> {
    /// Dispatch now, exactly as [`Offer::Admit`].
    Admit(T),
    /// [`AdmissionQueue::offer`] would have queued it; nothing was queued.
    WouldQueue(T),
}

#[derive(Debug)]
struct ClassQueue<T> {
    class: PolicyClass,
    /// Sorted by priority (best first).
    waiting: Vec<Waiting<T>>,
    deficit: u64,
    raw_isl_tokens: u64,
    cached_tokens: u64,
}

/// The admission queue of one partition.
#[derive(Debug)]
pub struct AdmissionQueue<T> {
    classes: Vec<ClassQueue<T>>,
    created_at: Instant,
    next_seq: u64,
    /// Round-robin position.
    cursor: usize,
}

impl<T> AdmissionQueue<T> {
    /// A queue over `classes` (index 0 is the fallback class), created at `now`.
    pub fn new(classes: Vec<PolicyClass>, now: Instant) -> Result<Self, QueueConfigError> {
        if classes.is_empty() {
            return Err(QueueConfigError::NoClasses);
        }
        for c in &classes {
            c.validate()?;
        }
        Ok(Self {
            classes: classes
                .into_iter()
                .map(|class| ClassQueue {
                    class,
                    waiting: Vec::new(),
                    deficit: 0,
                    raw_isl_tokens: 0,
                    cached_tokens: 0,
                })
                .collect(),
            created_at: now,
            next_seq: 0,
            cursor: 0,
        })
    }

    /// The index of the class called `name`.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.class.name == name)
    }

    /// The class at `index`.
    pub fn class(&self, index: usize) -> Option<&PolicyClass> {
        self.classes.get(index).map(|c| &c.class)
    }

    /// Requests waiting, all classes.
    pub fn len(&self) -> usize {
        self.classes.iter().map(|c| c.waiting.len()).sum()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.classes.iter().all(|c| c.waiting.is_empty())
    }

    /// Sum of the ISLs of waiting requests (`pending_isl_tokens`).
    pub fn pending_isl_tokens(&self) -> u64 {
        self.classes.iter().map(|c| c.raw_isl_tokens).sum()
    }

    /// Offers a request at `now`. `gate(class, request)` answers whether at least one of
    /// the request's eligible ranks (its pinned rank if pinned) is not busy for the class.
    /// After `Ok(Offer::Queued)` the caller drains with [`Self::next_ready`].
    pub fn offer<G>(
        &mut self,
        arrival: Arrival<T>,
        registered_workers: usize,
        now: Instant,
        gate: G,
    ) -> Result<Offer<T>, QueueRejected>
    where
        G: FnMut(&PolicyClass, &Waiting<T>) -> bool,
    {
        let class_index = arrival.class.min(self.classes.len() - 1);
        let jump = arrival.priority_jump.max(0.0);
        match self.admit_or_check(arrival, class_index, registered_workers, gate)? {
            Ok(payload) => Ok(Offer::Admit(payload)),
            Err(waiting) => {
                self.enqueue(class_index, waiting, jump, now);
                Ok(Offer::Queued)
            }
        }
    }

    /// [`Self::offer`] for a caller that must not wait: the same admission and the same
    /// rejections, but where `offer` would queue the request it is handed back
    /// ([`TryOffer::WouldQueue`]) and the queue is left as it was.
    pub fn try_offer<G>(
        &mut self,
        arrival: Arrival<T>,
        registered_workers: usize,
        gate: G,
    ) -> Result<TryOffer<T>, QueueRejected>
    where
        G: FnMut(&PolicyClass, &Waiting<T>) -> bool,
    {
        let class_index = arrival.class.min(self.classes.len() - 1);
        Ok(
            match self.admit_or_check(arrival, class_index, registered_workers, gate)? {
                Ok(payload) => TryOffer::Admit(payload),
                Err(waiting) => TryOffer::WouldQueue(waiting.payload),
            },
        )
    }

    /// Admits `arrival` now (`Ok(Ok(payload))`), rejects it against its class's limits, or
    /// returns it ready to be queued (`Ok(Err(waiting))`).
    fn admit_or_check<G>(
        &mut self,
        arrival: Arrival<T>,
        class_index: usize,
        registered_workers: usize,
        mut gate: G,
    ) -> Result<Result<T, Waiting<T>>, QueueRejected>
    where
        G: FnMut(&PolicyClass, &Waiting<T>) -> bool,
    {
        let cq = &mut self.classes[class_index];
        let waiting = Waiting {
            payload: arrival.payload,
            isl: arrival.isl,
            best_cached_tokens: arrival.best_cached_tokens,
            pinned: arrival.pinned,
            strict_priority: arrival.strict_priority,
            score: 0.0,
            seq: self.next_seq,
        };
        // With zero workers the request goes on and fails with NoEndpoints.
        if arrival.advisory || !cq.class.queueing_enabled() || registered_workers == 0 {
            return Ok(Ok(waiting.payload));
        }
        // A waiter ahead that could go now goes first (its drain is on the way); waiters
        // blocked on ranks that are busy for them hold up nobody else (§5.2).
        if gate(&cq.class, &waiting) && !cq.waiting.iter().any(|w| gate(&cq.class, w)) {
            return Ok(Ok(waiting.payload));
        }
        let n = registered_workers as u64;
        let totals = [
            (
                LimitKind::Requests,
                cq.class.request_queue_limit_per_worker,
                cq.waiting.len() as u64,
            ),
            (
                LimitKind::RawIslTokens,
                cq.class.raw_isl_token_queue_limit_per_worker,
                cq.raw_isl_tokens,
            ),
            (
                LimitKind::CachedTokens,
                cq.class.cached_token_queue_limit_per_worker,
                cq.cached_tokens,
            ),
        ];
        if cq.class.has_zero_limit() {
            // Never queues: admitted while a rank is free (checked even behind waiters,
            // which cannot exist in such a class), rejected otherwise.
            if gate(&cq.class, &waiting) {
                return Ok(Ok(waiting.payload));
            }
        }
        for (kind, limit, current) in totals {
            if let Some(l) = limit {
                let limit = l.saturating_mul(n);
                if current >= limit {
                    return Err(QueueRejected {
                        policy_class: cq.class.name.clone(),
                        limit_kind: kind,
                        current,
                        limit,
                    });
                }
            }
        }
        Ok(Err(waiting))
    }

    /// Queues `waiting` in its class, ranked by the class's policy.
    fn enqueue(&mut self, class_index: usize, waiting: Waiting<T>, jump: f64, now: Instant) {
        let offset = now.saturating_duration_since(self.created_at).as_secs_f64();
        let cq = &mut self.classes[class_index];
        let score = match cq.class.queue_policy {
            QueuePolicy::Fcfs => jump - offset,
            QueuePolicy::Lcfs => jump + offset,
            QueuePolicy::Wspt => (1.0 + jump) / waiting.uncached_tokens().max(1) as f64,
        };
        let waiting = Waiting {
            score,
            seq: self.next_seq,
            ..waiting
        };
        self.next_seq += 1;
        cq.raw_isl_tokens += waiting.isl;
        cq.cached_tokens += waiting.best_cached_tokens;
        let at = cq.waiting.partition_point(|w| w.ranks_before(&waiting));
        cq.waiting.insert(at, waiting);
    }

    /// The next request to dispatch, if any can go now.
    ///
    /// Within a class the best-ranked request whose gate passes goes first (a head blocked
    /// on its pinned rank does not block the others). Between classes, deficit round robin:
    /// each round adds `quantum` to the deficit of every class that has a dispatchable
    /// request, and dispatching costs `max(1, uncached tokens)`. Whole rounds are added at
    /// once, so a large cost never loops.
    pub fn next_ready<G>(&mut self, mut gate: G) -> Option<T>
    where
        G: FnMut(&PolicyClass, &Waiting<T>) -> bool,
    {
        let k = self.classes.len();
        // (class, entry index, rounds needed)
        let mut winner: Option<(usize, usize, u64)> = None;
        let mut ready = vec![None; k];
        for step in 0..k {
            let ci = (self.cursor + step) % k;
            let cq = &mut self.classes[ci];
            let Some(ei) = cq.waiting.iter().position(|w| gate(&cq.class, w)) else {
                // Standard DRR: a class with nothing to send keeps no credit.
                cq.deficit = 0;
                continue;
            };
            let cost = cq.waiting[ei].uncached_tokens().max(1);
            let rounds = cost.saturating_sub(cq.deficit).div_ceil(cq.class.quantum);
            ready[ci] = Some(rounds);
            if winner.is_none_or(|(_, _, r)| rounds < r) {
                winner = Some((ci, ei, rounds));
            }
        }
        let (ci, ei, rounds) = winner?;
        for (cq, r) in self.classes.iter_mut().zip(&ready) {
            if r.is_some() {
                cq.deficit = cq
                    .deficit
                    .saturating_add(rounds.saturating_mul(cq.class.quantum));
            }
        }
        let cq = &mut self.classes[ci];
        let w = cq.waiting.remove(ei);
        cq.deficit = cq.deficit.saturating_sub(w.uncached_tokens().max(1));
        cq.raw_isl_tokens -= w.isl;
        cq.cached_tokens -= w.best_cached_tokens;
        // Stay on the class while it has credit, as DRR does.
        self.cursor = ci;
        Some(w.payload)
    }

    /// Removes the waiting requests whose payload matches `which` (a caller that gave up);
    /// returns how many.
    pub fn remove_where(&mut self, mut which: impl FnMut(&T) -> bool) -> usize {
        let mut removed = 0;
        for cq in &mut self.classes {
            cq.waiting.retain(|w| {
                if which(&w.payload) {
                    cq.raw_isl_tokens -= w.isl;
                    cq.cached_tokens -= w.best_cached_tokens;
                    removed += 1;
                    false
                } else {
                    true
                }
            });
        }
        removed
    }

    /// Removes every waiting request (shutdown), best first per class.
    pub fn drain_all(&mut self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len());
        for cq in &mut self.classes {
            cq.raw_isl_tokens = 0;
            cq.cached_tokens = 0;
            cq.deficit = 0;
            out.extend(cq.waiting.drain(..).map(|w| w.payload));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(name: &str, policy: QueuePolicy) -> PolicyClass {
        PolicyClass {
            name: name.into(),
            queue_policy: policy,
            quantum: 1,
            prefill_busy_threshold: Some(100),
            prefill_busy_threshold_frac: None,
            request_queue_limit_per_worker: None,
            raw_isl_token_queue_limit_per_worker: None,
            cached_token_queue_limit_per_worker: None,
        }
    }

    fn arrival(id: u32, isl: u64) -> Arrival<u32> {
        Arrival {
            payload: id,
            class: 0,
            isl,
            best_cached_tokens: 0,
            priority_jump: 0.0,
            strict_priority: 0,
            pinned: None,
            advisory: false,
        }
    }

    fn drain(q: &mut AdmissionQueue<u32>) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(p) = q.next_ready(|_, _| true) {
            out.push(p);
        }
        out
    }

    #[test]
    fn busy_rule() {
        let mut c = class("c", QueuePolicy::Fcfs);
        assert!(!c.is_busy(100, None) && c.is_busy(101, None));
        c.prefill_busy_threshold = None;
        assert!(!c.queueing_enabled());
        c.prefill_busy_threshold_frac = Some(0.5);
        assert!(c.is_busy(51, Some(100)) && !c.is_busy(5_000_000, None));
    }

    #[test]
    fn waiters_blocked_on_their_ranks_do_not_hold_up_a_request_that_can_go() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(vec![class("c", QueuePolicy::Fcfs)], t0).unwrap();
        let mut pinned = arrival(1, 10);
        pinned.pinned = Some(kv_types::WorkerKey::new(1, 0));
        // Only the pinned rank is busy.
        let pin_busy = |_: &PolicyClass, w: &Waiting<u32>| w.pinned.is_none();
        assert!(matches!(
            q.offer(pinned, 2, t0, pin_busy),
            Ok(Offer::Queued)
        ));
        assert!(matches!(
            q.offer(arrival(2, 10), 2, t0, pin_busy),
            Ok(Offer::Admit(2))
        ));
        // Everything busy: 3 waits. Then 3 could go (its drain is due): 4 queues behind it.
        assert!(matches!(
            q.offer(arrival(3, 10), 2, t0, |_, _| false),
            Ok(Offer::Queued)
        ));
        assert!(matches!(
            q.offer(arrival(4, 10), 2, t0, |_, w| w.payload != 1),
            Ok(Offer::Queued)
        ));
        assert_eq!(q.len(), 3);
        // A waiter whose caller gave up leaves the counts with it.
        assert_eq!(q.remove_where(|&p| p == 3), 1);
        assert_eq!((q.len(), q.pending_isl_tokens()), (2, 20));
        assert_eq!(drain(&mut q), [1, 4]);
    }

    #[test]
    fn try_offer_admits_and_rejects_like_offer_but_never_queues() {
        let t0 = Instant::now();
        let mut limited = class("c", QueuePolicy::Fcfs);
        limited.request_queue_limit_per_worker = Some(1);
        let mut q = AdmissionQueue::new(vec![limited], t0).unwrap();
        assert!(matches!(
            q.try_offer(arrival(1, 10), 1, |_, _| true),
            Ok(TryOffer::Admit(1))
        ));
        assert!(matches!(
            q.try_offer(arrival(2, 10), 1, |_, _| false),
            Ok(TryOffer::WouldQueue(2))
        ));
        assert!(q.is_empty() && q.pending_isl_tokens() == 0);
        // Once someone waits, a free gate still does not jump the queue, and a full class
        // rejects exactly as `offer` does.
        assert!(matches!(
            q.offer(arrival(3, 10), 1, t0, |_, _| false),
            Ok(Offer::Queued)
        ));
        assert!(matches!(
            q.try_offer(arrival(4, 10), 1, |_, _| true),
            Err(QueueRejected {
                limit_kind: LimitKind::Requests,
                current: 1,
                limit: 1,
                ..
            })
        ));
        assert_eq!(q.len(), 1);
        assert_eq!(drain(&mut q), [3]);
        assert!(matches!(
            q.try_offer(arrival(5, 10), 1, |_, _| false),
            Ok(TryOffer::WouldQueue(5))
        ));
        assert!(q.is_empty());
    }

    #[test]
    fn admits_directly_when_free_or_unqueued_and_queues_otherwise() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(vec![class("c", QueuePolicy::Fcfs)], t0).unwrap();
        assert!(matches!(
            q.offer(arrival(1, 10), 1, t0, |_, _| true),
            Ok(Offer::Admit(1))
        ));
        assert!(matches!(
            q.offer(arrival(2, 10), 1, t0, |_, _| false),
            Ok(Offer::Queued)
        ));
        // Behind a waiter, even a free gate queues (the drain decides the order).
        assert!(matches!(
            q.offer(arrival(3, 10), 1, t0, |_, _| true),
            Ok(Offer::Queued)
        ));
        assert_eq!(q.pending_isl_tokens(), 20);
        let mut a = arrival(4, 10);
        a.advisory = true;
        assert!(matches!(
            q.offer(a, 1, t0, |_, _| false),
            Ok(Offer::Admit(4))
        ));
        assert!(matches!(
            q.offer(arrival(5, 10), 0, t0, |_, _| false),
            Ok(Offer::Admit(5))
        ));
        assert_eq!(drain(&mut q), vec![2, 3]);
        assert!(q.is_empty());
    }

    #[test]
    fn fcfs_with_priority_jump_and_strict_priority() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(vec![class("c", QueuePolicy::Fcfs)], t0).unwrap();
        let at = |s| t0 + Duration::from_secs(s);
        q.offer(arrival(1, 10), 1, at(0), |_, _| false).unwrap();
        q.offer(arrival(2, 10), 1, at(1), |_, _| false).unwrap();
        let mut jumper = arrival(3, 10);
        jumper.priority_jump = 5.0; // 5 − 2 = 3 beats 0 and −1
        q.offer(jumper, 1, at(2), |_, _| false).unwrap();
        let mut negative = arrival(4, 10);
        negative.priority_jump = -100.0; // clamped to 0: 0 − 3
        q.offer(negative, 1, at(3), |_, _| false).unwrap();
        let mut strict = arrival(5, 10);
        strict.strict_priority = 1;
        q.offer(strict, 1, at(4), |_, _| false).unwrap();
        assert_eq!(drain(&mut q), vec![5, 3, 1, 2, 4]);
    }

    #[test]
    fn wspt_prefers_short_uncached_work_and_lcfs_newest() {
        let t0 = Instant::now();
        let mut q = AdmissionQueue::new(vec![class("c", QueuePolicy::Wspt)], t0).unwrap();
        q.offer(arrival(1, 1000), 1, t0, |_, _| false).unwrap();
        q.offer(arrival(2, 100), 1, t0, |_, _| false).unwrap();
        let mut cached = arrival(3, 1000);
        cached.best_cached_tokens = 990;
        q.offer(cached, 1, t0, |_, _| false).unwrap();
        assert_eq!(drain(&mut q), vec![3, 2, 1]);

        let mut q = AdmissionQueue::new(vec![class("c", QueuePolicy::Lcfs)], t0).unwrap();
        for (i, s) in [(1, 0), (2, 1), (3, 2)] {
            q.offer(arrival(i, 10), 1, t0 + Duration::from_secs(s), |_, _| false)
                .unwrap();
        }
        assert_eq!(drain(&mut q), vec![3, 2, 1]);
    }

    #[test]
    fn pinned_head_does_not_block_others() {
        let t0 = Instant::now();
        let busy = WorkerKey::new(1, 0);
        let mut q = AdmissionQueue::new(vec![class("c", QueuePolicy::Fcfs)], t0).unwrap();
        let mut pinned = arrival(1, 10);
        pinned.pinned = Some(busy);
        q.offer(pinned, 2, t0, |_, _| false).unwrap();
        q.offer(arrival(2, 10), 2, t0 + Duration::from_secs(1), |_, _| false)
            .unwrap();
        let gate = |_: &PolicyClass, w: &Waiting<u32>| w.pinned != Some(busy);
        assert_eq!(q.next_ready(gate), Some(2));
        assert_eq!(q.next_ready(gate), None);
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn limits_reject_with_details_and_the_crossing_request_is_accepted() {
        let t0 = Instant::now();
        let mut c = class("small", QueuePolicy::Fcfs);
        c.raw_isl_token_queue_limit_per_worker = Some(50);
        let mut q = AdmissionQueue::new(vec![c], t0).unwrap();
        // N = 2 → limit 100 tokens. 60 + 60 crosses it and is accepted.
        q.offer(arrival(1, 60), 2, t0, |_, _| false).unwrap();
        q.offer(arrival(2, 60), 2, t0, |_, _| false).unwrap();
        let err = match q.offer(arrival(3, 1), 2, t0, |_, _| false) {
            Err(e) => e,
            Ok(_) => panic!("expected a rejection"),
        };
        assert_eq!(
            err,
            QueueRejected {
                policy_class: "small".into(),
                limit_kind: LimitKind::RawIslTokens,
                current: 120,
                limit: 100,
            }
        );
        assert_eq!(
            err.to_string(),
            "router policy class \"small\" queue raw_isl_tokens limit reached (current=120, limit=100)"
        );
    }

    #[test]
    fn zero_limit_never_queues() {
        let t0 = Instant::now();
        let mut c = class("z", QueuePolicy::Fcfs);
        c.request_queue_limit_per_worker = Some(0);
        let mut q = AdmissionQueue::new(vec![c], t0).unwrap();
        assert!(matches!(
            q.offer(arrival(1, 10), 3, t0, |_, _| true),
            Ok(Offer::Admit(1))
        ));
        let err = q.offer(arrival(2, 10), 3, t0, |_, _| false).err().unwrap();
        assert_eq!(
            (err.limit_kind, err.current, err.limit),
            (LimitKind::Requests, 0, 0)
        );
        assert!(q.is_empty());
    }

    #[test]
    fn deficit_round_robin_shares_by_quantum_and_cost() {
        let t0 = Instant::now();
        let mut big = class("big", QueuePolicy::Fcfs);
        big.quantum = 300;
        let small = PolicyClass {
            quantum: 100,
            ..class("small", QueuePolicy::Fcfs)
        };
        let mut q = AdmissionQueue::new(vec![big, small], t0).unwrap();
        for i in 0..6 {
            let mut a = arrival(i, 100);
            a.class = (i % 2) as usize;
            q.offer(a, 1, t0 + Duration::from_secs(i.into()), |_, _| false)
                .unwrap();
        }
        // Class 0 earns 3 requests' worth per round, class 1 one.
        assert_eq!(drain(&mut q), vec![0, 2, 4, 1, 3, 5]);
    }

    #[test]
    fn bad_classes_are_rejected() {
        let t0 = Instant::now();
        assert!(AdmissionQueue::<u32>::new(vec![], t0).is_err());
        let mut c = class("c", QueuePolicy::Fcfs);
        c.quantum = 0;
        assert!(AdmissionQueue::<u32>::new(vec![c], t0).is_err());
    }
}
