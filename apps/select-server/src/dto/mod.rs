//! Request and response bodies, shaped exactly like `spec/http-api.md`.
//!
//! Hashes are `u64` here as everywhere inside kv-select; the signed JSON rendering of §1.3 is
//! applied by the serde helpers of `codec` only. Rank-keyed maps are `BTreeMap<u32, _>`,
//! which serde_json writes and reads with decimal string keys (`"0"`, `"1"`).
//!
//! One file per concern: `request` (bodies and queries the routes parse, and their
//! conversion into service-builder's requests), `worker` (the worker routes' bodies and the
//! catalog record), `response` (what the other routes answer), over `codec` (field-level
//! serde helpers).

mod codec;
mod request;
mod response;
mod worker;

pub use request::{
    AffinityTarget, InputTrigger, LoadsQuery, MmRoutingInfo, OutputBlockRequest, PeerRegistration,
    PeerRequest, PinnedWorker, RouterConfigOverride, RoutingConstraints, SessionContext,
    WorkerQuery,
};
pub(crate) use request::{WirePromptQuery, WireReservation, WireSelection};
pub use response::{
    KvFetchPayload, KvHint, KvHintAction, Overlap, OverlapScoresResponse, PartitionLoads, RankLoad,
    RankOverlapScores, RawJson, ReadyResponse, ReservationResponse, SelectionResponse,
    SharedCacheScores, StatusOk, WorkerLoad,
};
pub use worker::{KvTransferEnforcement, Lifecycle, WorkerPatch, WorkerRecord, WorkerRequest};
