//! The service's metrics, exported through `prometheus-client`.
//!
//! Two kinds of series, on purpose:
//! - Events counted on the request path (selections, bookings, frees, expiries,
//!   rejections by reason, the selection latency) live in [`CoreMetrics`] as typed
//!   `prometheus-client` counters: one relaxed atomic increment each, no lock, no lookup
//!   (the rejection family's series are created up front and kept as handles).
//! - Values the service already keeps elsewhere (listener statistics, index counters and
//!   sizes, ledger and cache sizes, replica statistics) are read only at scrape time by the
//!   collector of `scrape.rs`, so the select and event-apply paths do no extra work for
//!   them.
//!
//! The latency histogram is a fixed-bucket atomic histogram of our own that encodes as a
//! Prometheus histogram: `prometheus-client`'s `Histogram` takes a mutex per observation,
//! which every selection would contend on.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

use crate::error::{ErrorKind, SelectionError};

/// The prefix of every series this crate registers.
pub const METRICS_PREFIX: &str = "kv_select";

/// Upper bounds (µs) of the selection-latency buckets; the last bucket is `+Inf`.
pub const SELECTION_LATENCY_BUCKETS_US: [u64; 10] = [
    25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 100_000, 1_000_000,
];

/// A fixed-bucket histogram (Prometheus semantics: cumulative on export). Clones share
/// the same buckets, like `prometheus-client`'s own metrics.
#[derive(Clone, Debug, Default)]
pub struct LatencyHistogram {
    inner: Arc<HistogramCells>,
}

#[derive(Debug, Default)]
struct HistogramCells {
    buckets: [AtomicU64; SELECTION_LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    pub fn observe(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = SELECTION_LATENCY_BUCKETS_US.partition_point(|&b| b < us);
        self.inner.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.inner.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// `(upper bound in µs or None for +Inf, cumulative count)` rows, then the sum in µs.
    pub fn snapshot(&self) -> (Vec<(Option<u64>, u64)>, u64) {
        let mut acc = 0;
        let rows = self
            .inner
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| {
                acc += b.load(Ordering::Relaxed);
                (SELECTION_LATENCY_BUCKETS_US.get(i).copied(), acc)
            })
            .collect();
        (rows, self.inner.sum_us.load(Ordering::Relaxed))
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum()
    }
}

impl TypedMetric for LatencyHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for LatencyHistogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> fmt::Result {
        // Per-bucket (not cumulative) counts: the encoder accumulates them. The count is
        // the sum of the buckets read, so `_count` always equals the `+Inf` bucket.
        let mut buckets = [(0.0, 0); SELECTION_LATENCY_BUCKETS_US.len() + 1];
        let mut count = 0;
        for (i, (slot, cell)) in buckets.iter_mut().zip(&self.inner.buckets).enumerate() {
            let n = cell.load(Ordering::Relaxed);
            let bound = SELECTION_LATENCY_BUCKETS_US
                .get(i)
                .map_or(f64::INFINITY, |&us| us as f64 / 1e6);
            *slot = (bound, n);
            count += n;
        }
        let sum = self.inner.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Which operation a rejection answered (`operation` label of `kv_select_rejections_total`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum RejectedOperation {
    Select,
    SelectAndReserve,
    /// `POST /reservations`.
    Reservation,
}

impl RejectedOperation {
    pub const ALL: [RejectedOperation; 3] = [
        RejectedOperation::Select,
        RejectedOperation::SelectAndReserve,
        RejectedOperation::Reservation,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            RejectedOperation::Select => "select",
            RejectedOperation::SelectAndReserve => "select_and_reserve",
            RejectedOperation::Reservation => "reservation",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// Why an operation was rejected (`reason` label of `kv_select_rejections_total`),
/// derived from the error's kind and status.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum RejectionReason {
    /// The request itself is invalid (400/422).
    BadRequest,
    /// An unknown partition, worker or reservation (404).
    NotFound,
    /// A duplicate selection or reservation id (409).
    Conflict,
    /// No schedulable worker can serve it, or the service is not ready / shutting down (503).
    NoSchedulable,
    /// The admission queue refused it (queue limits, 429 with rejection details).
    QueueRejected,
    /// It waited in the admission queue past its deadline (429).
    QueueTimeout,
    /// `--max-active-reservations` is reached (429).
    Capacity,
    /// Its caller went away while it waited; what it had claimed or booked is released.
    CallerGone,
    /// Anything else (500).
    Internal,
}

impl RejectionReason {
    pub const ALL: [RejectionReason; 9] = [
        RejectionReason::BadRequest,
        RejectionReason::NotFound,
        RejectionReason::Conflict,
        RejectionReason::NoSchedulable,
        RejectionReason::QueueRejected,
        RejectionReason::QueueTimeout,
        RejectionReason::Capacity,
        RejectionReason::CallerGone,
        RejectionReason::Internal,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            RejectionReason::BadRequest => "bad_request",
            RejectionReason::NotFound => "not_found",
            RejectionReason::Conflict => "conflict",
            RejectionReason::NoSchedulable => "no_schedulable",
            RejectionReason::QueueRejected => "queue_rejected",
            RejectionReason::QueueTimeout => "queue_timeout",
            RejectionReason::Capacity => "capacity",
            RejectionReason::CallerGone => "caller_gone",
            RejectionReason::Internal => "internal",
        }
    }

    /// The reason an error counts under.
    pub fn of(e: &SelectionError) -> Self {
        match (e.kind(), e.status_code()) {
            (ErrorKind::ResourceExhausted, _) => RejectionReason::Capacity,
            (_, 499) => RejectionReason::CallerGone,
            (_, 429) if e.details().is_some() => RejectionReason::QueueRejected,
            (_, 429) => RejectionReason::QueueTimeout,
            (ErrorKind::NotReady, _) | (_, 503) => RejectionReason::NoSchedulable,
            (ErrorKind::BadRequest, _) | (_, 400 | 422) => RejectionReason::BadRequest,
            (ErrorKind::NotFound, _) | (_, 404) => RejectionReason::NotFound,
            (ErrorKind::Conflict, _) | (_, 409) => RejectionReason::Conflict,
            _ => RejectionReason::Internal,
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

type RejectionLabels = [(&'static str, &'static str); 2];

/// Counters updated on the request path; read them for tests and embedders, or export
/// them with [`SelectionCore::register_metrics`](crate::SelectionCore::register_metrics).
#[derive(Debug)]
pub struct CoreMetrics {
    pub(crate) selections: Counter,
    pub(crate) bookings: Counter,
    pub(crate) selection_errors: Counter,
    pub(crate) pending_evictions: Counter,
    pub(crate) pending_expired: Counter,
    pub(crate) session_affinity_skipped: Counter,
    pub(crate) expired_reservations: Counter,
    pub(crate) reservations_rejected_full: Counter,
    pub(crate) frees: Counter,
    /// Wall time of `select` / `select_and_reserve` inside the core (queue wait included).
    pub(crate) selection_latency: LatencyHistogram,
    /// Requests that were queued rather than admitted at once.
    pub(crate) admission_waits: Counter,
    /// Time queued, until admitted, timed out or released by shutdown.
    pub(crate) admission_wait: LatencyHistogram,
    rejections: Family<RejectionLabels, Counter>,
    /// Handles into `rejections`, so counting one is an array index and an increment.
    rejection_cells: [[Counter; RejectionReason::ALL.len()]; RejectedOperation::ALL.len()],
}

impl Default for CoreMetrics {
    fn default() -> Self {
        let rejections = Family::<RejectionLabels, Counter>::default();
        let rejection_cells = RejectedOperation::ALL.map(|op| {
            RejectionReason::ALL.map(|reason| {
                rejections
                    .get_or_create(&[("operation", op.as_str()), ("reason", reason.as_str())])
                    .clone()
            })
        });
        Self {
            selections: Counter::default(),
            bookings: Counter::default(),
            selection_errors: Counter::default(),
            pending_evictions: Counter::default(),
            pending_expired: Counter::default(),
            session_affinity_skipped: Counter::default(),
            expired_reservations: Counter::default(),
            reservations_rejected_full: Counter::default(),
            frees: Counter::default(),
            selection_latency: LatencyHistogram::default(),
            admission_waits: Counter::default(),
            admission_wait: LatencyHistogram::default(),
            rejections,
            rejection_cells,
        }
    }
}

impl CoreMetrics {
    /// Successful `select` / `select_and_reserve` calls.
    pub fn selections(&self) -> u64 {
        self.selections.get()
    }
    /// Failed `select` / `select_and_reserve` calls.
    pub fn selection_errors(&self) -> u64 {
        self.selection_errors.get()
    }
    /// Bookings made (by `select_and_reserve` and `POST /reservations`).
    pub fn bookings(&self) -> u64 {
        self.bookings.get()
    }
    /// Reservations freed by `DELETE /reservations/{id}`.
    pub fn frees(&self) -> u64 {
        self.frees.get()
    }
    /// Pending selections evicted from the cache for space.
    pub fn pending_evictions(&self) -> u64 {
        self.pending_evictions.get()
    }
    /// Pending selections dropped after their TTL without a reservation.
    pub fn pending_expired(&self) -> u64 {
        self.pending_expired.get()
    }
    /// Session bookings that went ahead without affinity (full table, stuck initializer).
    pub fn session_affinity_skipped(&self) -> u64 {
        self.session_affinity_skipped.get()
    }
    /// Bookings reclaimed by expiry.
    pub fn expired_reservations(&self) -> u64 {
        self.expired_reservations.get()
    }
    /// Bookings refused because `--max-active-reservations` was reached.
    pub fn reservations_rejected(&self) -> u64 {
        self.reservations_rejected_full.get()
    }
    /// Rejections of `operation` for `reason`.
    pub fn rejections(&self, operation: RejectedOperation, reason: RejectionReason) -> u64 {
        self.rejection_cells[operation.index()][reason.index()].get()
    }
    pub fn selection_latency(&self) -> &LatencyHistogram {
        &self.selection_latency
    }
    /// Requests that waited in the admission queue (queued rather than admitted at once).
    pub fn admission_waits(&self) -> u64 {
        self.admission_waits.get()
    }
    /// Time each queued request waited, until admitted, timed out or shut down.
    pub fn admission_wait(&self) -> &LatencyHistogram {
        &self.admission_wait
    }

    /// Counts a failed operation under its reason.
    pub(crate) fn reject(&self, operation: RejectedOperation, e: &SelectionError) {
        self.rejection_cells[operation.index()][RejectionReason::of(e).index()].inc();
    }

    /// Registers the request-path series (handles sharing these counters) without prefix.
    /// `Registry::register` appends a period to each help text.
    pub(crate) fn register(&self, r: &mut Registry) {
        let counters = [
            ("selections", "Successful selections", &self.selections),
            (
                "selection_errors",
                "Failed selections",
                &self.selection_errors,
            ),
            ("bookings", "Bookings made", &self.bookings),
            ("frees", "Reservations freed by DELETE", &self.frees),
            (
                "pending_selection_evictions",
                "Pending selections evicted for space",
                &self.pending_evictions,
            ),
            (
                "pending_selections_expired",
                "Pending selections dropped after their TTL without a reservation",
                &self.pending_expired,
            ),
            (
                "session_affinity_skipped",
                "Bookings of a session that went ahead without affinity: its partition's \
                 session table was full, or the session's first booking was stuck",
                &self.session_affinity_skipped,
            ),
            (
                "expired_reservations",
                "Reservations reclaimed by expiry",
                &self.expired_reservations,
            ),
            (
                "reservations_rejected",
                "Bookings rejected by --max-active-reservations",
                &self.reservations_rejected_full,
            ),
            (
                "admission_waits",
                "Requests queued by the admission queue rather than admitted at once",
                &self.admission_waits,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "rejections",
            "Failed select, select_and_reserve and reservation calls, by operation and reason",
            self.rejections.clone(),
        );
        r.register_with_unit(
            "selection_duration",
            "Time inside the service per selection (queue wait included)",
            Unit::Seconds,
            self.selection_latency.clone(),
        );
        r.register_with_unit(
            "admission_wait_duration",
            "Time queued requests waited in the admission queue, until admitted, timed out or shut down",
            Unit::Seconds,
            self.admission_wait.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        let h = LatencyHistogram::default();
        for us in [10, 25, 26, 2_000_000] {
            h.observe(Duration::from_micros(us));
        }
        let (rows, sum) = h.snapshot();
        assert_eq!(rows[0], (Some(25), 2));
        assert_eq!(rows[1], (Some(50), 3));
        assert_eq!(rows.last(), Some(&(None, 4)));
        assert_eq!(sum, 10 + 25 + 26 + 2_000_000);
        assert_eq!(h.count(), 4);
    }

    #[test]
    fn histogram_encodes_as_prometheus_histogram() {
        let h = LatencyHistogram::default();
        for us in [10, 60, 2_000_000] {
            h.observe(Duration::from_micros(us));
        }
        let mut r = Registry::with_prefix("kv_select");
        r.register_with_unit("selection_duration", "h", Unit::Seconds, h.clone());
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &r).unwrap();
        assert!(text.contains("# TYPE kv_select_selection_duration_seconds histogram\n"));
        assert!(text.contains("kv_select_selection_duration_seconds_bucket{le=\"2.5e-05\"} 1\n"));
        assert!(text.contains("kv_select_selection_duration_seconds_bucket{le=\"0.0001\"} 2\n"));
        assert!(text.contains("kv_select_selection_duration_seconds_bucket{le=\"1\"} 2\n"));
        assert!(text.contains("kv_select_selection_duration_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("kv_select_selection_duration_seconds_sum 2.00007\n"));
        assert!(text.contains("kv_select_selection_duration_seconds_count 3\n"));
        assert_eq!(text.matches("_bucket{").count(), 11, "{text}");
    }

    #[test]
    fn rejection_reasons_follow_kind_and_status() {
        let check = |e: SelectionError, want: RejectionReason| {
            assert_eq!(RejectionReason::of(&e), want, "{e:?}");
        };
        check(
            SelectionError::bad_request("x"),
            RejectionReason::BadRequest,
        );
        check(SelectionError::not_found("x"), RejectionReason::NotFound);
        check(SelectionError::conflict("x"), RejectionReason::Conflict);
        check(
            SelectionError::not_ready("x"),
            RejectionReason::NoSchedulable,
        );
        check(
            SelectionError::scheduler(503, "x"),
            RejectionReason::NoSchedulable,
        );
        check(
            SelectionError::scheduler(429, "x"),
            RejectionReason::QueueTimeout,
        );
        check(
            SelectionError::scheduler(429, "x").with_details(crate::RejectionDetails {
                policy_class: "default".into(),
                limit_kind: "max_queue_depth".into(),
                current: 1,
                limit: 1,
            }),
            RejectionReason::QueueRejected,
        );
        check(
            SelectionError::new(ErrorKind::ResourceExhausted, 429, "x"),
            RejectionReason::Capacity,
        );
        check(
            SelectionError::sequence(409, "x"),
            RejectionReason::Conflict,
        );
        check(
            SelectionError::sequence(404, "x"),
            RejectionReason::NotFound,
        );
        check(
            SelectionError::scheduler(500, "x"),
            RejectionReason::Internal,
        );
        check(SelectionError::internal("x"), RejectionReason::Internal);
    }

    #[test]
    fn rejection_cells_share_the_family() {
        let m = CoreMetrics::default();
        m.reject(
            RejectedOperation::Reservation,
            &SelectionError::conflict("x"),
        );
        assert_eq!(
            m.rejections(RejectedOperation::Reservation, RejectionReason::Conflict),
            1
        );
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &r).unwrap();
        assert!(
            text.contains("rejections_total{operation=\"reservation\",reason=\"conflict\"} 1\n"),
            "{text}"
        );
        assert_eq!(
            text.matches("rejections_total{").count(),
            RejectedOperation::ALL.len() * RejectionReason::ALL.len()
        );
    }
}
