//! The endpoint picker's series (`kv_select_ext_proc_*`), beside the service's own in the
//! same registry. Every series is created up front and kept as a handle, so a pick does one
//! relaxed atomic increment per event and no label lookup.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use service_builder::LatencyHistogram;

use crate::request::LoadOnlyReason;

/// How a pick ended (`outcome` label of `kv_select_ext_proc_picks_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PickOutcome {
    /// An endpoint was chosen and booked.
    Picked,
    /// 503: no ready endpoint (none registered, none in the subset hint, none schedulable).
    Unavailable,
    /// 429: the admission queue shed the request.
    Shed,
}

impl PickOutcome {
    pub const ALL: [Self; 3] = [Self::Picked, Self::Unavailable, Self::Shed];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Picked => "picked",
            Self::Unavailable => "unavailable",
            Self::Shed => "shed",
        }
    }
}

/// What happened to a Process stream's booking (`event` label of
/// `kv_select_ext_proc_stream_events_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StreamEvent {
    /// A Process stream started.
    Opened,
    /// The first response body chunk marked the booking's prefill complete.
    PrefillComplete,
    /// The response ended and freed the booking.
    Completed,
    /// The stream broke or was cancelled with a booking live; the booking was freed.
    Cancelled,
    /// The served endpoint differed from the booked one; the booking moved to it.
    Moved,
    /// The served endpoint names no worker of the partition; the booking stayed.
    MoveUnknownEndpoint,
    /// A message the stream's state does not allow (a second request headers, say).
    ProtocolError,
}

impl StreamEvent {
    pub const ALL: [Self; 7] = [
        Self::Opened,
        Self::PrefillComplete,
        Self::Completed,
        Self::Cancelled,
        Self::Moved,
        Self::MoveUnknownEndpoint,
        Self::ProtocolError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Opened => "opened",
            Self::PrefillComplete => "prefill_complete",
            Self::Completed => "completed",
            Self::Cancelled => "cancelled",
            Self::Moved => "moved",
            Self::MoveUnknownEndpoint => "move_unknown_endpoint",
            Self::ProtocolError => "protocol_error",
        }
    }
}

type Labels = [(&'static str, &'static str); 1];

/// The picker's counters. Clones share the same series.
#[derive(Clone, Debug)]
pub struct ExtProcMetrics {
    picks_family: Family<Labels, Counter>,
    picks: [Counter; PickOutcome::ALL.len()],
    load_only_family: Family<Labels, Counter>,
    load_only: [Counter; LoadOnlyReason::ALL.len()],
    stream_family: Family<Labels, Counter>,
    stream: [Counter; StreamEvent::ALL.len()],
    tokenize: LatencyHistogram,
}

impl Default for ExtProcMetrics {
    fn default() -> Self {
        let picks_family = Family::<Labels, Counter>::default();
        let picks = PickOutcome::ALL.map(|o| {
            picks_family
                .get_or_create(&[("outcome", o.as_str())])
                .clone()
        });
        let load_only_family = Family::<Labels, Counter>::default();
        let load_only = LoadOnlyReason::ALL.map(|r| {
            load_only_family
                .get_or_create(&[("reason", r.as_str())])
                .clone()
        });
        let stream_family = Family::<Labels, Counter>::default();
        let stream = StreamEvent::ALL.map(|e| {
            stream_family
                .get_or_create(&[("event", e.as_str())])
                .clone()
        });
        Self {
            picks_family,
            picks,
            load_only_family,
            load_only,
            stream_family,
            stream,
            tokenize: LatencyHistogram::default(),
        }
    }
}

impl ExtProcMetrics {
    /// Puts every series into `registry` (the host's, shared with the service's series).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("kv_select_ext_proc");
        r.register(
            "picks",
            "Endpoint-picker decisions by outcome (picked, 503 unavailable, 429 shed)",
            self.picks_family.clone(),
        );
        r.register(
            "load_only_picks",
            "Picks made by load alone, without cache credit, by reason",
            self.load_only_family.clone(),
        );
        r.register(
            "stream_events",
            "Process-stream booking lifecycle events",
            self.stream_family.clone(),
        );
        r.register(
            "tokenize_seconds",
            "Time to render and tokenize a request's prompt",
            self.tokenize.clone(),
        );
    }

    pub(crate) fn pick(&self, o: PickOutcome) {
        self.picks[o as usize].inc();
    }

    pub(crate) fn load_only(&self, r: LoadOnlyReason) {
        self.load_only[r as usize].inc();
    }

    pub(crate) fn stream(&self, e: StreamEvent) {
        self.stream[e as usize].inc();
    }

    pub(crate) fn tokenize_time(&self, d: std::time::Duration) {
        self.tokenize.observe(d);
    }

    /// Current count of `e` (tests and the bench read it).
    pub fn stream_events(&self, e: StreamEvent) -> u64 {
        self.stream[e as usize].get()
    }

    pub fn picks(&self, o: PickOutcome) -> u64 {
        self.picks[o as usize].get()
    }

    pub fn load_only_picks(&self, r: LoadOnlyReason) -> u64 {
        self.load_only[r as usize].get()
    }
}
