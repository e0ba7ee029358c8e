//! Sans-IO MessagePack codec of both topics (`spec/replica-sync.md` §3, §4.1, §7.1).
//!
//! The encoder writes exactly what a serde "struct-as-map" encoder writes: maps keyed by field
//! name in declaration order, smallest integer/str/array forms, `nil` for `None`, unit
//! variants as strings, struct variants as one-entry maps. It appends to a caller-owned
//! buffer and allocates nothing else.
//!
//! The decoder follows serde semantics as far as the reference does: key order is free,
//! unknown keys are skipped, a missing `Option` field is `None`, a missing
//! `track_prefill_tokens` is `true`, a missing required field or a duplicated known field
//! rejects the whole message. It walks the fixed schema directly (so recursion depth is fixed
//! by the schema), skips unknown values iteratively, and checks every declared length against
//! the bytes left before reserving anything: it cannot panic, and allocates at most the
//! strings it returns plus `8 ×` the input size for the hash vector.
//! Trailing bytes after the document are ignored, like `rmp_serde::from_slice` does.

use std::time::Duration;

use kv_types::{DpRank, SequenceHash, WorkerId, WorkerKey};

use crate::event::{
    Admission, PrefillLoadHint, ReplicaEvent, RouterId, SequenceEvent, SequenceEventKind,
    SessionBinding, Topic,
};

/// An event that msgpack cannot represent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A string or array longer than msgpack's 32-bit length limit.
    #[error("field `{field}` is too long for msgpack ({len} > 4294967295)")]
    TooLong { field: &'static str, len: usize },
}

/// Why a payload could not be decoded. `field` names the schema field being read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The topic frame is neither of the two known topics.
    #[error("unknown topic")]
    UnknownTopic,
    /// Not well-formed msgpack at this point.
    #[error("malformed msgpack in `{field}`: {problem}")]
    Malformed {
        field: &'static str,
        problem: WireProblem,
    },
    /// Well-formed, but of a type the schema does not allow.
    #[error("`{field}` has the wrong msgpack type")]
    WrongType { field: &'static str },
    /// An integer that does not fit the field's type (or a negative one).
    #[error("`{field}` is out of range")]
    OutOfRange { field: &'static str },
    /// A required field is absent.
    #[error("missing field `{field}`")]
    MissingField { field: &'static str },
    /// A known field appears twice in one map.
    #[error("duplicate field `{field}`")]
    DuplicateField { field: &'static str },
    /// A `data` variant other than `AddRequest`, `Free`, `MarkPrefillCompleted`.
    #[error("unknown event variant `{variant}`")]
    UnknownVariant { variant: String },
}

/// Low-level msgpack failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireProblem {
    #[error("input ends inside a value")]
    Truncated,
    #[error("reserved marker 0xc1")]
    ReservedMarker,
    #[error("declared length exceeds the input")]
    LengthExceedsInput,
    #[error("string is not UTF-8")]
    BadUtf8,
}

/// Appends the payload of `event` to `buf` and returns the topic to send it on.
pub fn encode(event: &ReplicaEvent, buf: &mut Vec<u8>) -> Result<Topic, EncodeError> {
    encode_as(event, event.origin(), buf)
}

/// Like [`encode`] but writes `origin` as `router_id` / `writer_id`: the mesh stamps its own
/// id on everything it publishes.
pub(crate) fn encode_as(
    event: &ReplicaEvent,
    origin: RouterId,
    buf: &mut Vec<u8>,
) -> Result<Topic, EncodeError> {
    let start = buf.len();
    let result = match event {
        ReplicaEvent::Sequence(e) => encode_sequence(e, origin, buf).map(|()| Topic::SlotTracker),
        ReplicaEvent::Binding(b) => encode_binding(b, origin, buf).map(|()| Topic::SessionAffinity),
    };
    if result.is_err() {
        buf.truncate(start);
    }
    result
}

/// Decodes a payload of the given topic frame.
pub fn decode(topic: &[u8], payload: &[u8]) -> Result<ReplicaEvent, DecodeError> {
    match Topic::from_frame(topic) {
        Some(Topic::SlotTracker) => decode_sequence(payload).map(ReplicaEvent::Sequence),
        Some(Topic::SessionAffinity) => decode_binding(payload).map(ReplicaEvent::Binding),
        None => Err(DecodeError::UnknownTopic),
    }
}

// ---------------------------------------------------------------------------------------------
// Encoder

fn encode_sequence(
    e: &SequenceEvent,
    origin: RouterId,
    buf: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    put_map_len(buf, 4);
    put_key(buf, "model_name");
    put_str(buf, "model_name", &e.model_name)?;
    put_key(buf, "routing_group");
    put_str(buf, "routing_group", &e.routing_group)?;
    put_key(buf, "block_size");
    put_uint(buf, u64::from(e.block_size));
    put_key(buf, "event");
    put_map_len(buf, 5);
    put_key(buf, "request_id");
    put_str(buf, "request_id", &e.request_id)?;
    put_key(buf, "worker");
    put_map_len(buf, 2);
    put_key(buf, "worker_id");
    put_uint(buf, e.worker.worker_id.0);
    put_key(buf, "dp_rank");
    put_uint(buf, u64::from(e.worker.dp_rank.0));
    put_key(buf, "data");
    match &e.kind {
        SequenceEventKind::AddRequest(a) => {
            put_map_len(buf, 1);
            put_key(buf, "AddRequest");
            encode_admission(a, buf)?;
        }
        SequenceEventKind::Free => put_key(buf, "Free"),
        SequenceEventKind::MarkPrefillCompleted => put_key(buf, "MarkPrefillCompleted"),
    }
    put_key(buf, "router_id");
    put_uint(buf, origin.0);
    put_key(buf, "lora_name");
    match &e.lora_name {
        Some(l) => put_str(buf, "lora_name", l)?,
        None => put_nil(buf),
    }
    Ok(())
}

fn encode_admission(a: &Admission, buf: &mut Vec<u8>) -> Result<(), EncodeError> {
    put_map_len(buf, 4);
    put_key(buf, "token_sequence");
    match &a.tracking_hashes {
        Some(hashes) => {
            put_array_len(buf, "token_sequence", hashes.len())?;
            for h in hashes {
                put_uint(buf, h.0);
            }
        }
        None => put_nil(buf),
    }
    put_key(buf, "track_prefill_tokens");
    buf.push(if a.track_prefill_tokens { 0xc3 } else { 0xc2 });
    put_key(buf, "expected_output_tokens");
    match a.expected_output_tokens {
        Some(n) => put_uint(buf, u64::from(n)),
        None => put_nil(buf),
    }
    put_key(buf, "prefill_load_hint");
    match &a.prefill_load_hint {
        Some(hint) => {
            put_map_len(buf, 2);
            put_key(buf, "initial_effective_prefill_tokens");
            put_uint(buf, hint.initial_effective_prefill_tokens);
            put_key(buf, "expected_prefill_duration");
            match hint.expected_prefill_duration {
                Some(d) => {
                    put_map_len(buf, 2);
                    put_key(buf, "secs");
                    put_uint(buf, d.as_secs());
                    put_key(buf, "nanos");
                    put_uint(buf, u64::from(d.subsec_nanos()));
                }
                None => put_nil(buf),
            }
        }
        None => put_nil(buf),
    }
    Ok(())
}

fn encode_binding(
    b: &SessionBinding,
    origin: RouterId,
    buf: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    put_map_len(buf, 7);
    put_key(buf, "model_name");
    put_str(buf, "model_name", &b.model_name)?;
    put_key(buf, "routing_group");
    put_str(buf, "routing_group", &b.routing_group)?;
    put_key(buf, "session_id");
    put_str(buf, "session_id", &b.session_id)?;
    put_key(buf, "worker_id");
    put_uint(buf, b.worker_id.0);
    put_key(buf, "dp_rank");
    match b.dp_rank {
        Some(r) => put_uint(buf, u64::from(r.0)),
        None => put_nil(buf),
    }
    put_key(buf, "sequence");
    put_uint(buf, b.sequence);
    put_key(buf, "writer_id");
    put_uint(buf, origin.0);
    Ok(())
}

fn put_nil(buf: &mut Vec<u8>) {
    buf.push(0xc0);
}

fn put_uint(buf: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        buf.push(v as u8);
    } else if let Ok(v) = u8::try_from(v) {
        buf.extend_from_slice(&[0xcc, v]);
    } else if let Ok(v) = u16::try_from(v) {
        buf.push(0xcd);
        buf.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(v) {
        buf.push(0xce);
        buf.extend_from_slice(&v.to_be_bytes());
    } else {
        buf.push(0xcf);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

/// Field names and variant names are short literals: never too long.
fn put_key(buf: &mut Vec<u8>, key: &'static str) {
    debug_assert!(key.len() < 256);
    if key.len() < 32 {
        buf.push(0xa0 | key.len() as u8);
    } else {
        buf.extend_from_slice(&[0xd9, key.len() as u8]);
    }
    buf.extend_from_slice(key.as_bytes());
}

fn put_str(buf: &mut Vec<u8>, field: &'static str, s: &str) -> Result<(), EncodeError> {
    let len = s.len();
    if len < 32 {
        buf.push(0xa0 | len as u8);
    } else if let Ok(n) = u8::try_from(len) {
        buf.extend_from_slice(&[0xd9, n]);
    } else if let Ok(n) = u16::try_from(len) {
        buf.push(0xda);
        buf.extend_from_slice(&n.to_be_bytes());
    } else if let Ok(n) = u32::try_from(len) {
        buf.push(0xdb);
        buf.extend_from_slice(&n.to_be_bytes());
    } else {
        return Err(EncodeError::TooLong { field, len });
    }
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_array_len(buf: &mut Vec<u8>, field: &'static str, len: usize) -> Result<(), EncodeError> {
    if len < 16 {
        buf.push(0x90 | len as u8);
    } else if let Ok(n) = u16::try_from(len) {
        buf.push(0xdc);
        buf.extend_from_slice(&n.to_be_bytes());
    } else if let Ok(n) = u32::try_from(len) {
        buf.push(0xdd);
        buf.extend_from_slice(&n.to_be_bytes());
    } else {
        return Err(EncodeError::TooLong { field, len });
    }
    Ok(())
}

/// Map lengths of the schema are small constants.
fn put_map_len(buf: &mut Vec<u8>, len: u8) {
    debug_assert!(len < 16);
    buf.push(0x80 | len);
}

// ---------------------------------------------------------------------------------------------
// Decoder

fn decode_sequence(payload: &[u8]) -> Result<SequenceEvent, DecodeError> {
    let mut r = Reader { buf: payload };
    let mut model_name = None;
    let mut routing_group = None;
    let mut block_size = None;
    let mut event = None;
    let n = r.map_len("envelope")?;
    for _ in 0..n {
        let Some(key) = r.field(
            "envelope",
            &["model_name", "routing_group", "block_size", "event"],
        )?
        else {
            continue;
        };
        match key {
            "model_name" => set_once(&mut model_name, key, r.string(key)?)?,
            "routing_group" => set_once(&mut routing_group, key, r.string(key)?)?,
            "block_size" => set_once(&mut block_size, key, r.u32(key)?)?,
            "event" => set_once(&mut event, "event", decode_event(&mut r)?)?,
            _ => r.skip("envelope")?,
        }
    }
    let (request_id, worker, kind, router_id, lora_name) = required(event, "event")?;
    Ok(SequenceEvent {
        model_name: required(model_name, "model_name")?,
        routing_group: required(routing_group, "routing_group")?,
        block_size: required(block_size, "block_size")?,
        request_id,
        worker,
        router_id,
        lora_name,
        kind,
    })
}

type EventParts = (
    String,
    WorkerKey,
    SequenceEventKind,
    RouterId,
    Option<String>,
);

fn decode_event(r: &mut Reader<'_>) -> Result<EventParts, DecodeError> {
    let mut request_id = None;
    let mut worker = None;
    let mut data = None;
    let mut router_id = None;
    let mut lora_name: Option<Option<String>> = None;
    let n = r.map_len("event")?;
    for _ in 0..n {
        let Some(key) = r.field(
            "event",
            &["request_id", "worker", "data", "router_id", "lora_name"],
        )?
        else {
            continue;
        };
        match key {
            "request_id" => set_once(&mut request_id, key, r.string(key)?)?,
            "worker" => set_once(&mut worker, key, decode_worker(r)?)?,
            "data" => set_once(&mut data, key, decode_data(r)?)?,
            "router_id" => set_once(&mut router_id, key, RouterId(r.u64(key)?))?,
            "lora_name" => {
                let v = if r.nil()? { None } else { Some(r.string(key)?) };
                set_once(&mut lora_name, key, v)?;
            }
            _ => r.skip("event")?,
        }
    }
    Ok((
        required(request_id, "request_id")?,
        required(worker, "worker")?,
        required(data, "data")?,
        required(router_id, "router_id")?,
        lora_name.flatten(),
    ))
}

fn decode_worker(r: &mut Reader<'_>) -> Result<WorkerKey, DecodeError> {
    let mut worker_id = None;
    let mut dp_rank = None;
    let n = r.map_len("worker")?;
    for _ in 0..n {
        let Some(key) = r.field("worker", &["worker_id", "dp_rank"])? else {
            continue;
        };
        match key {
            "worker_id" => set_once(&mut worker_id, key, r.u64(key)?)?,
            "dp_rank" => set_once(&mut dp_rank, key, r.u32(key)?)?,
            _ => r.skip("worker")?,
        }
    }
    Ok(WorkerKey::new(
        required(worker_id, "worker_id")?,
        required(dp_rank, "dp_rank")?,
    ))
}

fn decode_data(r: &mut Reader<'_>) -> Result<SequenceEventKind, DecodeError> {
    match r.peek("data")? {
        Kind::Str => {
            let variant = r.str("data")?;
            unit_variant(variant)
        }
        Kind::Map => {
            if r.map_len("data")? != 1 {
                return Err(DecodeError::WrongType { field: "data" });
            }
            let variant = r.str("data")?;
            if variant == "AddRequest" {
                return decode_admission(r).map(SequenceEventKind::AddRequest);
            }
            let kind = unit_variant(variant)?;
            // serde accepts `{"Free": nil}` for a unit variant too.
            if r.nil()? {
                Ok(kind)
            } else {
                Err(DecodeError::WrongType { field: "data" })
            }
        }
        _ => Err(DecodeError::WrongType { field: "data" }),
    }
}

fn unit_variant(variant: &str) -> Result<SequenceEventKind, DecodeError> {
    match variant {
        "Free" => Ok(SequenceEventKind::Free),
        "MarkPrefillCompleted" => Ok(SequenceEventKind::MarkPrefillCompleted),
        // A struct variant written as a bare string.
        "AddRequest" => Err(DecodeError::WrongType { field: "data" }),
        other => Err(DecodeError::UnknownVariant {
            variant: other.to_owned(),
        }),
    }
}

fn decode_admission(r: &mut Reader<'_>) -> Result<Admission, DecodeError> {
    let mut tokens: Option<Option<Vec<SequenceHash>>> = None;
    let mut track: Option<bool> = None;
    let mut expected: Option<Option<u32>> = None;
    let mut hint: Option<Option<PrefillLoadHint>> = None;
    let n = r.map_len("AddRequest")?;
    for _ in 0..n {
        let Some(key) = r.field(
            "AddRequest",
            &[
                "token_sequence",
                "track_prefill_tokens",
                "expected_output_tokens",
                "prefill_load_hint",
            ],
        )?
        else {
            continue;
        };
        match key {
            "token_sequence" => {
                let v = if r.nil()? {
                    None
                } else {
                    let len = r.array_len(key)?;
                    // `len` is bounded by the bytes left (checked by `array_len`).
                    let mut hashes = Vec::with_capacity(len);
                    for _ in 0..len {
                        hashes.push(SequenceHash(r.u64(key)?));
                    }
                    Some(hashes)
                };
                set_once(&mut tokens, key, v)?;
            }
            "track_prefill_tokens" => set_once(&mut track, key, r.bool(key)?)?,
            "expected_output_tokens" => {
                let v = if r.nil()? { None } else { Some(r.u32(key)?) };
                set_once(&mut expected, key, v)?;
            }
            "prefill_load_hint" => {
                let v = if r.nil()? {
                    None
                } else {
                    Some(decode_hint(r)?)
                };
                set_once(&mut hint, key, v)?;
            }
            _ => r.skip("AddRequest")?,
        }
    }
    Ok(Admission {
        tracking_hashes: tokens.flatten(),
        track_prefill_tokens: track.unwrap_or(true),
        expected_output_tokens: expected.flatten(),
        prefill_load_hint: hint.flatten(),
    })
}

fn decode_hint(r: &mut Reader<'_>) -> Result<PrefillLoadHint, DecodeError> {
    let mut tokens = None;
    let mut duration: Option<Option<Duration>> = None;
    let n = r.map_len("prefill_load_hint")?;
    for _ in 0..n {
        let Some(key) = r.field(
            "prefill_load_hint",
            &[
                "initial_effective_prefill_tokens",
                "expected_prefill_duration",
            ],
        )?
        else {
            continue;
        };
        match key {
            "initial_effective_prefill_tokens" => set_once(&mut tokens, key, r.u64(key)?)?,
            "expected_prefill_duration" => {
                let v = if r.nil()? {
                    None
                } else {
                    Some(decode_duration(r)?)
                };
                set_once(&mut duration, key, v)?;
            }
            _ => r.skip("prefill_load_hint")?,
        }
    }
    Ok(PrefillLoadHint {
        initial_effective_prefill_tokens: required(tokens, "initial_effective_prefill_tokens")?,
        expected_prefill_duration: duration.flatten(),
    })
}

fn decode_duration(r: &mut Reader<'_>) -> Result<Duration, DecodeError> {
    const FIELD: &str = "expected_prefill_duration";
    let mut secs = None;
    let mut nanos = None;
    let n = r.map_len(FIELD)?;
    for _ in 0..n {
        let Some(key) = r.field(FIELD, &["secs", "nanos"])? else {
            continue;
        };
        match key {
            "secs" => set_once(&mut secs, key, r.u64(key)?)?,
            "nanos" => set_once(&mut nanos, key, r.u32(key)?)?,
            _ => r.skip(FIELD)?,
        }
    }
    let secs = required(secs, "secs")?;
    let nanos = required(nanos, "nanos")?;
    // serde normalises nanos >= 1e9 into seconds and rejects the overflow; `Duration::new`
    // would panic on it.
    Duration::from_secs(secs)
        .checked_add(Duration::from_nanos(u64::from(nanos)))
        .ok_or(DecodeError::OutOfRange { field: FIELD })
}

fn decode_binding(payload: &[u8]) -> Result<SessionBinding, DecodeError> {
    let mut r = Reader { buf: payload };
    let mut model_name = None;
    let mut routing_group = None;
    let mut session_id = None;
    let mut worker_id = None;
    let mut dp_rank: Option<Option<u32>> = None;
    let mut sequence = None;
    let mut writer_id = None;
    let n = r.map_len("binding")?;
    for _ in 0..n {
        let Some(key) = r.field(
            "binding",
            &[
                "model_name",
                "routing_group",
                "session_id",
                "worker_id",
                "dp_rank",
                "sequence",
                "writer_id",
            ],
        )?
        else {
            continue;
        };
        match key {
            "model_name" => set_once(&mut model_name, key, r.string(key)?)?,
            "routing_group" => set_once(&mut routing_group, key, r.string(key)?)?,
            "session_id" => set_once(&mut session_id, key, r.string(key)?)?,
            "worker_id" => set_once(&mut worker_id, key, r.u64(key)?)?,
            "dp_rank" => {
                let v = if r.nil()? { None } else { Some(r.u32(key)?) };
                set_once(&mut dp_rank, key, v)?;
            }
            "sequence" => set_once(&mut sequence, key, r.u64(key)?)?,
            "writer_id" => set_once(&mut writer_id, key, r.u64(key)?)?,
            _ => r.skip("binding")?,
        }
    }
    Ok(SessionBinding {
        model_name: required(model_name, "model_name")?,
        routing_group: required(routing_group, "routing_group")?,
        session_id: required(session_id, "session_id")?,
        worker_id: WorkerId(required(worker_id, "worker_id")?),
        dp_rank: dp_rank.flatten().map(DpRank),
        sequence: required(sequence, "sequence")?,
        writer_id: RouterId(required(writer_id, "writer_id")?),
    })
}

fn set_once<T>(slot: &mut Option<T>, field: &'static str, value: T) -> Result<(), DecodeError> {
    if slot.is_some() {
        return Err(DecodeError::DuplicateField { field });
    }
    *slot = Some(value);
    Ok(())
}

fn required<T>(slot: Option<T>, field: &'static str) -> Result<T, DecodeError> {
    slot.ok_or(DecodeError::MissingField { field })
}

/// The msgpack family of the next value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

/// A bounds-checked cursor over one payload.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn malformed(field: &'static str, problem: WireProblem) -> DecodeError {
        DecodeError::Malformed { field, problem }
    }

    fn peek(&self, field: &'static str) -> Result<Kind, DecodeError> {
        let &b = self
            .buf
            .first()
            .ok_or(Self::malformed(field, WireProblem::Truncated))?;
        Ok(match b {
            0x00..=0x7f | 0xcc..=0xd3 | 0xe0..=0xff => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc1 => return Err(Self::malformed(field, WireProblem::ReservedMarker)),
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xca | 0xcb => Kind::Float,
        })
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return Err(Self::malformed(field, WireProblem::LengthExceedsInput));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn byte(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        let (&b, rest) = self
            .buf
            .split_first()
            .ok_or(Self::malformed(field, WireProblem::Truncated))?;
        self.buf = rest;
        Ok(b)
    }

    /// A big-endian unsigned integer of `n` (≤ 8) bytes.
    fn be(&mut self, n: usize, field: &'static str) -> Result<u64, DecodeError> {
        if n > self.buf.len() {
            return Err(Self::malformed(field, WireProblem::Truncated));
        }
        let bytes = self.take(n, field)?;
        Ok(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn nil(&mut self) -> Result<bool, DecodeError> {
        if self.buf.first() == Some(&0xc0) {
            self.buf = &self.buf[1..];
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn bool(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match self.peek(field)? {
            Kind::Bool => Ok(self.byte(field)? == 0xc3),
            _ => Err(DecodeError::WrongType { field }),
        }
    }

    /// Any msgpack integer that is non-negative (serde accepts signed markers in range).
    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        if self.peek(field)? != Kind::Int {
            return Err(DecodeError::WrongType { field });
        }
        let m = self.byte(field)?;
        let signed = |v: i64| u64::try_from(v).map_err(|_| DecodeError::OutOfRange { field });
        match m {
            0x00..=0x7f => Ok(u64::from(m)),
            0xe0..=0xff => Err(DecodeError::OutOfRange { field }),
            0xcc => self.be(1, field),
            0xcd => self.be(2, field),
            0xce => self.be(4, field),
            0xcf => self.be(8, field),
            0xd0 => signed(i64::from(self.be(1, field)? as u8 as i8)),
            0xd1 => signed(i64::from(self.be(2, field)? as u16 as i16)),
            0xd2 => signed(i64::from(self.be(4, field)? as u32 as i32)),
            _ => signed(self.be(8, field)? as i64),
        }
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        u32::try_from(self.u64(field)?).map_err(|_| DecodeError::OutOfRange { field })
    }

    fn str(&mut self, field: &'static str) -> Result<&'a str, DecodeError> {
        let len = match self.byte(field)? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.be(1, field)? as usize,
            0xda => self.be(2, field)? as usize,
            0xdb => self.be(4, field)? as usize,
            _ => return Err(DecodeError::WrongType { field }),
        };
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes).map_err(|_| Self::malformed(field, WireProblem::BadUtf8))
    }

    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        self.str(field).map(str::to_owned)
    }

    /// Reads a map key and returns it as one of the `known` field names. Any other key
    /// (including a non-string one) has its value skipped and yields `Ok(None)`, so callers
    /// just continue; returning the `'static` literal lets errors name the field.
    fn field(
        &mut self,
        map: &'static str,
        known: &[&'static str],
    ) -> Result<Option<&'static str>, DecodeError> {
        let key = if self.peek(map)? == Kind::Str {
            Some(self.str(map)?)
        } else {
            self.skip(map)?;
            None
        };
        match key.and_then(|k| known.iter().copied().find(|f| *f == k)) {
            Some(f) => Ok(Some(f)),
            None => {
                self.skip(map)?;
                Ok(None)
            }
        }
    }

    /// A map header; the pair count is at most half the bytes left.
    fn map_len(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let len = match self.byte(field)? {
            m @ 0x80..=0x8f => u64::from(m & 0x0f),
            0xde => self.be(2, field)?,
            0xdf => self.be(4, field)?,
            _ => return Err(DecodeError::WrongType { field }),
        };
        self.check_items(2 * len, field)?;
        Ok(len as usize)
    }

    /// An array header; the count is at most the bytes left (each element takes ≥ 1 byte),
    /// so it is safe as a capacity.
    fn array_len(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let len = match self.byte(field)? {
            m @ 0x90..=0x9f => u64::from(m & 0x0f),
            0xdc => self.be(2, field)?,
            0xdd => self.be(4, field)?,
            _ => return Err(DecodeError::WrongType { field }),
        };
        self.check_items(len, field)?;
        Ok(len as usize)
    }

    fn check_items(&self, items: u64, field: &'static str) -> Result<(), DecodeError> {
        if items > self.buf.len() as u64 {
            Err(Self::malformed(field, WireProblem::LengthExceedsInput))
        } else {
            Ok(())
        }
    }

    /// Skips one complete value. Iterative: a count of values still owed, so hostile nesting
    /// costs no stack; the count never exceeds the bytes left.
    fn skip(&mut self, field: &'static str) -> Result<(), DecodeError> {
        let mut owed: u64 = 1;
        while owed > 0 {
            owed -= 1;
            let m = self.byte(field)?;
            let data: u64 = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0x80..=0x8f => {
                    owed += 2 * u64::from(m & 0x0f);
                    0
                }
                0x90..=0x9f => {
                    owed += u64::from(m & 0x0f);
                    0
                }
                0xa0..=0xbf => u64::from(m & 0x1f),
                0xc1 => return Err(Self::malformed(field, WireProblem::ReservedMarker)),
                0xc4 | 0xd9 => self.be(1, field)?,
                0xc5 | 0xda => self.be(2, field)?,
                0xc6 | 0xdb => self.be(4, field)?,
                0xc7 => self.be(1, field)? + 1,
                0xc8 => self.be(2, field)? + 1,
                0xc9 => self.be(4, field)? + 1,
                0xca => 4,
                0xcb => 8,
                0xcc | 0xd0 => 1,
                0xcd | 0xd1 => 2,
                0xce | 0xd2 => 4,
                0xcf | 0xd3 => 8,
                0xd4 => 2,
                0xd5 => 3,
                0xd6 => 5,
                0xd7 => 9,
                0xd8 => 17,
                0xdc => {
                    owed += self.be(2, field)?;
                    0
                }
                0xdd => {
                    owed += self.be(4, field)?;
                    0
                }
                0xde => {
                    owed += 2 * self.be(2, field)?;
                    0
                }
                0xdf => {
                    owed += 2 * self.be(4, field)?;
                    0
                }
            };
            self.check_items(owed, field)?;
            let n = usize::try_from(data)
                .map_err(|_| Self::malformed(field, WireProblem::LengthExceedsInput))?;
            self.take(n, field)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{SESSION_AFFINITY_TOPIC, SLOT_TRACKER_TOPIC};
    use proptest::prelude::*;

    /// Parses spaced hex as written in the spec.
    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
        assert_eq!(digits.len() % 2, 0);
        digits
            .chunks(2)
            .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
            .collect()
    }

    const ENVELOPE_HEAD: &str = "
        84
          aa 6d6f64656c5f6e616d65 a1 6d
          ad 726f7574696e675f67726f7570 a7 64656661756c74
          aa 626c6f636b5f73697a65 10
          a5 6576656e74
          85
            aa 726571756573745f6964 a2 7231
            a6 776f726b6572
            82 a9 776f726b65725f6964 07 a7 64705f72616e6b 00
            a4 64617461";
    const ADD_REQUEST_DATA: &str = "
            81 aa 41646452657175657374
              84
                ae 746f6b656e5f73657175656e6365 92 01 02
                b4 747261636b5f70726566696c6c5f746f6b656e73 c3
                b6 65787065637465645f6f75747075745f746f6b656e73 c0
                b1 70726566696c6c5f6c6f61645f68696e74
                  82 d9 20 696e697469616c5f6566666563746976655f70726566696c6c5f746f6b656e73 18
                     b9 65787065637465645f70726566696c6c5f6475726174696f6e c0";
    const ENVELOPE_TAIL: &str = "
            a9 726f757465725f6964 2a
            a9 6c6f72615f6e616d65 c0";
    const FREE_DATA: &str = "a4 46726565";
    const PREFILL_DONE_DATA: &str = "b4 4d61726b50726566696c6c436f6d706c65746564";
    const BINDING_HEX: &str = "
        87 aa 6d6f64656c5f6e616d65 a1 6d
           ad 726f7574696e675f67726f7570 a7 64656661756c74
           aa 73657373696f6e5f6964 a2 7331
           a9 776f726b65725f6964 07
           a7 64705f72616e6b 00
           a8 73657175656e6365 cd 03e8
           a9 7772697465725f6964 2a";

    fn sequence_hex(data: &str) -> Vec<u8> {
        hex(&format!("{ENVELOPE_HEAD} {data} {ENVELOPE_TAIL}"))
    }

    fn spec_event(kind: SequenceEventKind) -> SequenceEvent {
        SequenceEvent {
            model_name: "m".into(),
            routing_group: "default".into(),
            block_size: 16,
            request_id: "r1".into(),
            worker: WorkerKey::new(7, 0),
            router_id: RouterId(42),
            lora_name: None,
            kind,
        }
    }

    fn spec_admission() -> Admission {
        Admission {
            tracking_hashes: Some(vec![SequenceHash(1), SequenceHash(2)]),
            track_prefill_tokens: true,
            expected_output_tokens: None,
            prefill_load_hint: Some(PrefillLoadHint {
                initial_effective_prefill_tokens: 24,
                expected_prefill_duration: None,
            }),
        }
    }

    fn spec_binding() -> SessionBinding {
        SessionBinding {
            model_name: "m".into(),
            routing_group: "default".into(),
            session_id: "s1".into(),
            worker_id: WorkerId(7),
            dp_rank: Some(DpRank(0)),
            sequence: 1000,
            writer_id: RouterId(42),
        }
    }

    /// Golden check both ways: encode == bytes and decode(bytes) == value.
    fn check_golden(event: ReplicaEvent, bytes: &[u8]) {
        let mut buf = Vec::new();
        let topic = encode(&event, &mut buf).unwrap();
        assert_eq!(topic, event.topic());
        assert_eq!(buf, bytes, "encoding differs from the spec's hex");
        assert_eq!(decode(topic.as_str().as_bytes(), bytes).unwrap(), event);
    }

    #[test]
    fn golden_add_request() {
        check_golden(
            ReplicaEvent::Sequence(spec_event(SequenceEventKind::AddRequest(spec_admission()))),
            &sequence_hex(ADD_REQUEST_DATA),
        );
    }

    #[test]
    fn golden_free() {
        check_golden(
            ReplicaEvent::Sequence(spec_event(SequenceEventKind::Free)),
            &sequence_hex(FREE_DATA),
        );
    }

    #[test]
    fn golden_mark_prefill_completed() {
        check_golden(
            ReplicaEvent::Sequence(spec_event(SequenceEventKind::MarkPrefillCompleted)),
            &sequence_hex(PREFILL_DONE_DATA),
        );
    }

    #[test]
    fn golden_session_binding() {
        check_golden(ReplicaEvent::Binding(spec_binding()), &hex(BINDING_HEX));
    }

    #[test]
    fn encode_appends_and_stamps_origin() {
        let event = ReplicaEvent::Binding(spec_binding());
        let mut buf = vec![0xff];
        encode_as(&event, RouterId(u64::MAX), &mut buf).unwrap();
        assert_eq!(buf[0], 0xff);
        let ReplicaEvent::Binding(b) =
            decode(SESSION_AFFINITY_TOPIC.as_bytes(), &buf[1..]).unwrap()
        else {
            panic!("wrong variant")
        };
        assert_eq!(b.writer_id, RouterId(u64::MAX));
        // A real random id is written as uint64.
        assert_eq!(
            &buf[buf.len() - 9..],
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]
        );
    }

    #[test]
    fn integers_and_strings_use_the_smallest_form() {
        let check = |v: u64, expected: &str| {
            let mut buf = Vec::new();
            put_uint(&mut buf, v);
            assert_eq!(buf, hex(expected), "{v}");
        };
        check(0, "00");
        check(127, "7f");
        check(128, "cc80");
        check(255, "ccff");
        check(256, "cd0100");
        check(65535, "cdffff");
        check(65536, "ce00010000");
        check(u64::from(u32::MAX), "ceffffffff");
        check(1 << 32, "cf0000000100000000");

        let check_str = |len: usize, header: &str| {
            let mut buf = Vec::new();
            put_str(&mut buf, "s", &"x".repeat(len)).unwrap();
            assert_eq!(&buf[..buf.len() - len], hex(header).as_slice(), "{len}");
        };
        check_str(0, "a0");
        check_str(31, "bf");
        check_str(32, "d920");
        check_str(255, "d9ff");
        check_str(256, "da0100");
        check_str(65536, "db00010000");

        let check_arr = |len: usize, header: &str| {
            let mut buf = Vec::new();
            put_array_len(&mut buf, "a", len).unwrap();
            assert_eq!(buf, hex(header), "{len}");
        };
        check_arr(15, "9f");
        check_arr(16, "dc0010");
        check_arr(65536, "dd00010000");
    }

    /// A test-only builder for hand-made payloads (reordered, extra or missing keys).
    #[derive(Default)]
    struct B(Vec<u8>);

    impl B {
        fn map(mut self, n: u8) -> Self {
            put_map_len(&mut self.0, n);
            self
        }
        fn s(mut self, s: &str) -> Self {
            put_str(&mut self.0, "t", s).unwrap();
            self
        }
        fn u(mut self, v: u64) -> Self {
            put_uint(&mut self.0, v);
            self
        }
        fn raw(mut self, h: &str) -> Self {
            self.0.extend(hex(h));
            self
        }
        fn worker(self, id: u64, rank: u64) -> Self {
            self.map(2).s("worker_id").u(id).s("dp_rank").u(rank)
        }
    }

    fn sequence(payload: &[u8]) -> Result<SequenceEvent, DecodeError> {
        match decode(SLOT_TRACKER_TOPIC.as_bytes(), payload)? {
            ReplicaEvent::Sequence(e) => Ok(e),
            ReplicaEvent::Binding(_) => unreachable!(),
        }
    }

    #[test]
    fn decode_ignores_order_and_unknown_keys_and_defaults_options() {
        // Event first, unknown keys with nested values, no lora_name, minimal AddRequest.
        let payload = B::default()
            .map(6)
            .s("event")
            .map(5)
            .s("data")
            .map(1)
            .s("AddRequest")
            .map(1)
            .s("extra")
            .raw("92 81 a1 61 c3 dc0001 cb 0000000000000000")
            .s("router_id")
            .u(u64::MAX)
            .s("worker")
            .worker(3, 2)
            .s("request_id")
            .s("abc")
            .s("future")
            .raw("c4 02 0102")
            .s("partition")
            .s("ignored")
            .s("block_size")
            .u(64)
            .u(5) // a non-string key: skipped with its value
            .raw("d6 01 01020304")
            .s("routing_group")
            .s("g")
            .s("model_name")
            .s("llama")
            .0;
        let e = sequence(&payload).unwrap();
        assert_eq!(
            e,
            SequenceEvent {
                model_name: "llama".into(),
                routing_group: "g".into(),
                block_size: 64,
                request_id: "abc".into(),
                worker: WorkerKey::new(3, 2),
                router_id: RouterId(u64::MAX),
                lora_name: None,
                kind: SequenceEventKind::AddRequest(Admission {
                    tracking_hashes: None,
                    track_prefill_tokens: true,
                    expected_output_tokens: None,
                    prefill_load_hint: None,
                }),
            }
        );
    }

    fn envelope_with(data: B, extra_event_keys: &[(&str, &str)]) -> Vec<u8> {
        let mut b = B::default()
            .map(4)
            .s("model_name")
            .s("m")
            .s("routing_group")
            .s("g")
            .s("block_size")
            .u(16)
            .s("event")
            .map(4 + extra_event_keys.len() as u8)
            .s("request_id")
            .s("r")
            .s("worker")
            .worker(1, 0)
            .s("router_id")
            .u(9)
            .s("data");
        b.0.extend(data.0);
        for (k, v) in extra_event_keys {
            b = b.s(k).raw(v);
        }
        b.0
    }

    #[test]
    fn decode_full_admission_with_duration_and_lora() {
        let data = B::default()
            .map(1)
            .s("AddRequest")
            .map(4)
            .s("prefill_load_hint")
            .map(2)
            .s("expected_prefill_duration")
            .map(2)
            .s("nanos")
            .u(500)
            .s("secs")
            .u(3)
            .s("initial_effective_prefill_tokens")
            .u(70_000)
            .s("expected_output_tokens")
            .u(128)
            .s("track_prefill_tokens")
            .raw("c2")
            .s("token_sequence")
            .raw("dc0003 00 cf ffffffffffffffff d3 0000000000000005");
        let e = sequence(&envelope_with(data, &[("lora_name", "a4 6c6f7261")])).unwrap();
        assert_eq!(e.lora_name.as_deref(), Some("lora"));
        let SequenceEventKind::AddRequest(a) = e.kind else {
            panic!("not an admission")
        };
        assert_eq!(
            a,
            Admission {
                tracking_hashes: Some(vec![
                    SequenceHash(0),
                    SequenceHash(u64::MAX),
                    SequenceHash(5)
                ]),
                track_prefill_tokens: false,
                expected_output_tokens: Some(128),
                prefill_load_hint: Some(PrefillLoadHint {
                    initial_effective_prefill_tokens: 70_000,
                    expected_prefill_duration: Some(Duration::new(3, 500)),
                }),
            }
        );
        // And it round-trips through the encoder.
        let mut buf = Vec::new();
        let event = ReplicaEvent::Sequence(SequenceEvent {
            kind: SequenceEventKind::AddRequest(a),
            ..e
        });
        encode(&event, &mut buf).unwrap();
        assert_eq!(decode(SLOT_TRACKER_TOPIC.as_bytes(), &buf).unwrap(), event);
    }

    #[test]
    fn unit_variant_as_single_entry_map_is_accepted() {
        let data = B::default().map(1).s("Free").raw("c0");
        assert_eq!(
            sequence(&envelope_with(data, &[])).unwrap().kind,
            SequenceEventKind::Free
        );
    }

    fn check_err(payload: &[u8], expected: DecodeError) {
        assert_eq!(sequence(payload).unwrap_err(), expected);
    }

    #[test]
    fn decode_rejections() {
        check_err(
            &envelope_with(B::default().s("Bogus"), &[]),
            DecodeError::UnknownVariant {
                variant: "Bogus".into(),
            },
        );
        check_err(
            &envelope_with(B::default().s("AddRequest"), &[]),
            DecodeError::WrongType { field: "data" },
        );
        check_err(
            &envelope_with(B::default().s("Free"), &[("router_id", "01")]),
            DecodeError::DuplicateField { field: "router_id" },
        );
        check_err(
            &envelope_with(B::default().s("Free"), &[("lora_name", "07")]),
            DecodeError::WrongType { field: "lora_name" },
        );
        // AddRequest hint without its required token count.
        let data = B::default()
            .map(1)
            .s("AddRequest")
            .map(1)
            .s("prefill_load_hint")
            .map(0);
        check_err(
            &envelope_with(data, &[]),
            DecodeError::MissingField {
                field: "initial_effective_prefill_tokens",
            },
        );
        // Duration overflow is an error, not a panic.
        let data = B::default()
            .map(1)
            .s("AddRequest")
            .map(1)
            .s("prefill_load_hint")
            .map(2)
            .s("initial_effective_prefill_tokens")
            .u(1)
            .s("expected_prefill_duration")
            .map(2)
            .s("secs")
            .u(u64::MAX)
            .s("nanos")
            .u(2_000_000_000);
        check_err(
            &envelope_with(data, &[]),
            DecodeError::OutOfRange {
                field: "expected_prefill_duration",
            },
        );
        // A legacy envelope carrying tenant_id instead of routing_group.
        let legacy = B::default()
            .map(4)
            .s("model_name")
            .s("m")
            .s("tenant_id")
            .s("g")
            .s("block_size")
            .u(16)
            .s("event")
            .raw("80")
            .0;
        check_err(
            &legacy,
            DecodeError::MissingField {
                field: "request_id",
            },
        );
        let legacy = B::default()
            .map(3)
            .s("model_name")
            .s("m")
            .s("tenant_id")
            .s("g")
            .s("block_size")
            .u(16)
            .0;
        check_err(&legacy, DecodeError::MissingField { field: "event" });
        // Out-of-range integers.
        let mut big_block = sequence_hex(FREE_DATA);
        let pos = big_block.iter().position(|&b| b == 0x10).unwrap();
        big_block.splice(pos..=pos, hex("cf 0000000100000000"));
        check_err(
            &big_block,
            DecodeError::OutOfRange {
                field: "block_size",
            },
        );
        let mut negative = sequence_hex(FREE_DATA);
        let last = negative.len() - 1 - 11;
        assert_eq!(negative[last], 0x2a);
        negative[last] = 0xff; // -1
        check_err(&negative, DecodeError::OutOfRange { field: "router_id" });
    }

    #[test]
    fn binding_decodes_worker_only_and_rejects_missing_fields() {
        let mut b = hex(BINDING_HEX);
        let pos = b.windows(7).position(|w| w == b"dp_rank").unwrap() + 7;
        b[pos] = 0xc0;
        let ReplicaEvent::Binding(binding) = decode(SESSION_AFFINITY_TOPIC.as_bytes(), &b).unwrap()
        else {
            panic!("wrong variant")
        };
        assert_eq!(binding.dp_rank, None);

        let missing = B::default().map(1).s("model_name").s("m").0;
        assert_eq!(
            decode(SESSION_AFFINITY_TOPIC.as_bytes(), &missing).unwrap_err(),
            DecodeError::MissingField {
                field: "routing_group"
            }
        );
        assert_eq!(
            decode(b"dynamo.session-affinity.v2", &hex(BINDING_HEX)).unwrap_err(),
            DecodeError::UnknownTopic
        );
    }

    #[test]
    fn hostile_lengths_are_rejected_before_allocation() {
        for h in [
            "dfffffffff",              // map32 of 4G pairs
            "dd ffffffff",             // array where a map is expected
            "81 a1 78 ddffffffff",     // unknown key whose value claims 4G items
            "81 a1 78 dbffffffff",     // ... or a 4 GiB string
            "81 a1 78 c9ffffffff 01",  // ... or a 4 GiB ext
            "81 a1 78 91919191919191", // nested arrays that end early
            "c1",
            "",
        ] {
            assert!(sequence(&hex(h)).is_err(), "{h}");
        }
        // A token_sequence that claims more elements than bytes left.
        let data = B::default()
            .map(1)
            .s("AddRequest")
            .map(1)
            .s("token_sequence")
            .raw("dd 7fffffff 01");
        assert_eq!(
            sequence(&envelope_with(data, &[])).unwrap_err(),
            DecodeError::Malformed {
                field: "token_sequence",
                problem: WireProblem::LengthExceedsInput
            }
        );
    }

    fn arb_string() -> impl Strategy<Value = String> {
        prop_oneof![".{0,40}", "[a-z]{250,300}"]
    }

    fn arb_event() -> impl Strategy<Value = ReplicaEvent> {
        let admission = (
            proptest::option::of(proptest::collection::vec(any::<u64>(), 0..40)),
            any::<bool>(),
            proptest::option::of(any::<u32>()),
            proptest::option::of((
                any::<u64>(),
                proptest::option::of((any::<u64>(), 0u32..1_000_000_000)),
            )),
        )
            .prop_map(|(hashes, track, expected, hint)| Admission {
                tracking_hashes: hashes.map(|h| h.into_iter().map(SequenceHash).collect()),
                track_prefill_tokens: track,
                expected_output_tokens: expected,
                prefill_load_hint: hint.map(|(tokens, d)| PrefillLoadHint {
                    initial_effective_prefill_tokens: tokens,
                    expected_prefill_duration: d.map(|(s, n)| Duration::new(s, n)),
                }),
            });
        let kind = prop_oneof![
            admission.prop_map(SequenceEventKind::AddRequest),
            Just(SequenceEventKind::Free),
            Just(SequenceEventKind::MarkPrefillCompleted),
        ];
        let sequence = (
            (arb_string(), arb_string(), any::<u32>(), arb_string()),
            (any::<u64>(), any::<u32>(), any::<u64>()),
            proptest::option::of(arb_string()),
            kind,
        )
            .prop_map(|((m, g, bs, rid), (w, r, origin), lora, kind)| {
                ReplicaEvent::Sequence(SequenceEvent {
                    model_name: m,
                    routing_group: g,
                    block_size: bs,
                    request_id: rid,
                    worker: WorkerKey::new(w, r),
                    router_id: RouterId(origin),
                    lora_name: lora,
                    kind,
                })
            });
        let binding = (
            (arb_string(), arb_string(), arb_string()),
            (
                any::<u64>(),
                proptest::option::of(any::<u32>()),
                any::<u64>(),
                any::<u64>(),
            ),
        )
            .prop_map(|((m, g, s), (w, r, seq, writer))| {
                ReplicaEvent::Binding(SessionBinding {
                    model_name: m,
                    routing_group: g,
                    session_id: s,
                    worker_id: WorkerId(w),
                    dp_rank: r.map(DpRank),
                    sequence: seq,
                    writer_id: RouterId(writer),
                })
            });
        prop_oneof![sequence, binding]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn round_trip(event in arb_event()) {
            let mut buf = Vec::new();
            let topic = encode(&event, &mut buf).unwrap();
            prop_assert_eq!(decode(topic.as_str().as_bytes(), &buf).unwrap(), event);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(SLOT_TRACKER_TOPIC.as_bytes(), &bytes);
            let _ = decode(SESSION_AFFINITY_TOPIC.as_bytes(), &bytes);
        }

        #[test]
        fn mutated_valid_payloads_never_panic(
            event in arb_event(),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut buf = Vec::new();
            let topic = encode(&event, &mut buf).unwrap();
            for (at, byte) in edits {
                let i = at.index(buf.len());
                buf[i] = byte;
            }
            let _ = decode(topic.as_str().as_bytes(), &buf);
            let end = cut.index(buf.len() + 1);
            let _ = decode(topic.as_str().as_bytes(), &buf[..end]);
        }
    }
}
