//! Sans-IO decoding of live frames and msgpack batches into typed, borrowed events
//! (`spec/kv-events.md` §3–§5). No normalization happens here; see [`crate::Normalizer`].

use kv_types::{BlockMmInfo, ExternalHash, MmObject};

use crate::reader::{Kind, Reader, WireError};
use crate::spares::Spares;

/// Why a live multipart message was rejected before its payload was looked at (§3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("live message has {count} frames, expected 3")]
    WrongFrameCount { count: usize },
    #[error("sequence frame is {len} bytes, expected 8")]
    BadSeqLength { len: usize },
}

/// Why a batch payload could not be decoded; the whole batch is dropped (§4, §11).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes are not well-formed msgpack (truncated, reserved marker, a declared length
    /// larger than the input).
    #[error("malformed msgpack in {field}: {detail}")]
    Malformed {
        field: &'static str,
        detail: &'static str,
    },
    #[error("field {field} has the wrong type, expected {expected}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    #[error("field {field} is out of range")]
    OutOfRange { field: &'static str },
    #[error("required field {field} is missing")]
    MissingField { field: &'static str },
    #[error("batch array has {len} elements, expected 3")]
    BatchArity { len: usize },
    #[error("unknown event type {tag:?}")]
    UnknownEventType { tag: String },
}

impl DecodeError {
    fn wire(e: WireError, field: &'static str, expected: &'static str) -> Self {
        match e {
            WireError::Truncated => DecodeError::Malformed {
                field,
                detail: "input ends inside a value",
            },
            WireError::Reserved => DecodeError::Malformed {
                field,
                detail: "reserved marker 0xc1",
            },
            WireError::LengthExceedsInput => DecodeError::Malformed {
                field,
                detail: "declared length exceeds the input",
            },
            WireError::BadUtf8 => DecodeError::WrongType {
                field,
                expected: "UTF-8 string",
            },
            WireError::WrongType => DecodeError::WrongType { field, expected },
        }
    }
}

/// Attaches field context to a low-level error.
trait At<T> {
    fn at(self, field: &'static str, expected: &'static str) -> Result<T, DecodeError>;
}

impl<T> At<T> for Result<T, WireError> {
    fn at(self, field: &'static str, expected: &'static str) -> Result<T, DecodeError> {
        self.map_err(|e| DecodeError::wire(e, field, expected))
    }
}

/// A live message split into its three frames (§3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    /// Ignored by the service; kept for logs.
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// Checks the framing of a live message: exactly `[topic, seq (8 bytes BE), payload]`.
pub fn parse_live_frames<'a>(frames: &[&'a [u8]]) -> Result<LiveMessage<'a>, FrameError> {
    let [topic, seq, payload] = frames else {
        return Err(FrameError::WrongFrameCount {
            count: frames.len(),
        });
    };
    Ok(LiveMessage {
        topic,
        seq: parse_seq(seq)?,
        payload,
    })
}

/// An 8-byte big-endian sequence frame.
pub fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::BadSeqLength { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// One decoded batch, borrowing strings from the payload.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch<'a> {
    /// Publisher timestamp; informative only.
    pub ts: f64,
    pub events: Vec<RawEvent<'a>>,
    /// The batch's `data_parallel_rank`, already reinterpreted as `u32` (`-1` → `u32::MAX`).
    pub dp_rank: Option<u32>,
}

impl EventBatch<'_> {
    /// Gives the events' vectors to `spares` for the next batch's decoding.
    pub(crate) fn give_back(self, spares: &mut Spares) {
        for event in self.events {
            match event {
                RawEvent::Stored(stored) => {
                    spares.keep_ids(stored.token_ids);
                    spares.keep_hashes(stored.block_hashes);
                }
                RawEvent::Removed(removed) => spares.keep_hashes(removed.block_hashes),
                RawEvent::Cleared(_) | RawEvent::Ignored => {}
            }
        }
    }
}

/// One engine event as decoded, before filtering.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum RawEvent<'a> {
    Stored(BlockStored<'a>),
    Removed(BlockRemoved<'a>),
    Cleared(AllBlocksCleared<'a>),
    /// The `Ignored` tag: decodes, then is always filtered.
    Ignored,
}

/// `BlockStored` in either shape (§5.2, §5.3). Empty strings are already `None`.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockStored<'a> {
    pub block_hashes: Vec<ExternalHash>,
    pub parent_block_hash: Option<ExternalHash>,
    /// Flattened tokens of all blocks (Eagle pairs already flattened).
    pub token_ids: Vec<u32>,
    /// The tokens came as `[u32, u32]` pairs.
    pub is_eagle: bool,
    pub block_size: u64,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    /// Explicit salt, or the one tagged in block 0's `extra_keys`.
    pub cache_salt: Option<&'a str>,
    /// Explicit `block_mm_infos`, or the ones recognized in `extra_keys`.
    pub block_mm_infos: Option<Vec<Option<BlockMmInfo>>>,
    pub meta: GroupMeta<'a>,
    pub session_id: Option<&'a str>,
}

/// `BlockRemoved` in either shape (§5.4).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockRemoved<'a> {
    pub block_hashes: Vec<ExternalHash>,
    pub medium: Option<&'a str>,
    pub meta: GroupMeta<'a>,
}

/// `AllBlocksCleared` (§5.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AllBlocksCleared<'a> {
    pub ownership: Option<&'a str>,
}

/// KV-cache group metadata and provenance carried by stores and removals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct GroupMeta<'a> {
    pub group_idx: Option<u32>,
    pub kind: Option<CacheSpecKind>,
    pub sliding_window: Option<u32>,
    pub locality: Option<Locality>,
    pub ownership: Option<&'a str>,
}

/// `kv_cache_spec_kind` (§6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CacheSpecKind {
    FullAttention,
    MlaAttention,
    SlidingWindow,
    SlidingWindowMla,
    Mamba,
    ChunkedLocalAttention,
    SinkFullAttention,
    EncoderOnlyAttention,
    CrossAttention,
    /// Any string not listed in the spec.
    Unknown,
}

impl CacheSpecKind {
    pub fn parse(s: &str) -> Self {
        match s {
            "full_attention" => Self::FullAttention,
            "mla_attention" => Self::MlaAttention,
            "sliding_window" => Self::SlidingWindow,
            "sliding_window_mla" => Self::SlidingWindowMla,
            "mamba" => Self::Mamba,
            "chunked_local_attention" => Self::ChunkedLocalAttention,
            "sink_full_attention" => Self::SinkFullAttention,
            "encoder_only_attention" => Self::EncoderOnlyAttention,
            "cross_attention" => Self::CrossAttention,
            _ => Self::Unknown,
        }
    }

    /// Main attention groups are the only ones whose blocks are indexed.
    pub const fn is_main_attention(self) -> bool {
        matches!(
            self,
            Self::FullAttention | Self::MlaAttention | Self::SinkFullAttention
        )
    }
}

/// `locality` of an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Locality {
    Local,
    Remote,
    /// Any other string.
    Unknown,
}

impl Locality {
    pub fn parse(s: &str) -> Self {
        match s {
            "LOCAL" => Self::Local,
            "REMOTE" => Self::Remote,
            _ => Self::Unknown,
        }
    }
}

/// Prefix that marks a cache salt inside vLLM `extra_keys` (§5.6).
const SALT_PREFIX: &str = "dynamo-cache-salt:";

/// Decodes one batch payload (§4): the 3-element array every vLLM and SGLang release sends.
/// Any other batch value, a msgpack map included, is an undecodable batch (`bad_batch_shape`):
/// the contract rejects it and the listener's watermark does not move. Bytes after the batch
/// value are ignored.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch<'_>, DecodeError> {
    decode_batch_reusing(payload, &mut Spares::default())
}

/// [`decode_batch`], taking the events' vectors from `spares` (a listener group gives them
/// back once the batch is normalized, so a steady stream allocates nothing per event).
pub fn decode_batch_reusing<'a>(
    payload: &'a [u8],
    spares: &mut Spares,
) -> Result<EventBatch<'a>, DecodeError> {
    let mut r = Reader::new(payload);
    match r.kind().at("batch", "array")? {
        Kind::Array => {
            let len = r.read_array_len().at("batch", "array")?;
            if len != 3 {
                return Err(DecodeError::BatchArity { len });
            }
            let ts = r.read_number().at("ts", "number")?;
            let events = decode_events(&mut r, spares)?;
            let dp_rank = decode_dp_rank(&mut r)?;
            Ok(EventBatch {
                ts,
                events,
                dp_rank,
            })
        }
        _ => Err(DecodeError::WrongType {
            field: "batch",
            expected: "array",
        }),
    }
}

/// A map key: `Some` for a string key, `None` (already skipped) for any other key type.
fn read_key<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    if r.kind().at("map key", "string")? == Kind::Str {
        r.read_str().map(Some).at("map key", "string")
    } else {
        r.skip().at("map key", "msgpack value")?;
        Ok(None)
    }
}

fn decode_dp_rank(r: &mut Reader<'_>) -> Result<Option<u32>, DecodeError> {
    const FIELD: &str = "data_parallel_rank";
    if r.try_nil().at(FIELD, "int or nil")? {
        return Ok(None);
    }
    let v = r.read_int().at(FIELD, "int or nil")?;
    let v = i32::try_from(v).map_err(|_| DecodeError::OutOfRange { field: FIELD })?;
    // Bit reinterpretation, as the reference does: -1 becomes u32::MAX.
    Ok(Some(v as u32))
}

fn decode_events<'a>(
    r: &mut Reader<'a>,
    spares: &mut Spares,
) -> Result<Vec<RawEvent<'a>>, DecodeError> {
    let n = r.read_array_len().at("events", "array")?;
    // The count is bounded by the bytes left, but an event decodes into far more memory
    // than its smallest encoding, so growth is left to actual successful decodes.
    let mut events = Vec::with_capacity(n.min(256));
    for _ in 0..n {
        events.push(decode_event(r, spares)?);
    }
    Ok(events)
}

fn decode_event<'a>(r: &mut Reader<'a>, spares: &mut Spares) -> Result<RawEvent<'a>, DecodeError> {
    match r.kind().at("event", "array or map")? {
        Kind::Array => decode_positional(r, spares),
        Kind::Map => decode_map(r, spares),
        _ => Err(DecodeError::WrongType {
            field: "event",
            expected: "array or map",
        }),
    }
}

fn unknown_tag(tag: &str) -> DecodeError {
    // Bounded copy: the tag comes from the wire and only feeds logs.
    let tag: String = tag.chars().take(64).collect();
    DecodeError::UnknownEventType { tag }
}

// ---------------------------------------------------------------------------------------
// Positional form
// ---------------------------------------------------------------------------------------

/// Reads the elements of one positional event array, tracking how many remain so absent
/// trailing fields read as nil and surplus ones are skipped.
struct Positional<'r, 'a> {
    r: &'r mut Reader<'a>,
    left: usize,
}

impl<'a> Positional<'_, 'a> {
    /// The next element, or `None` when the array ended.
    fn next(&mut self) -> Option<&mut Reader<'a>> {
        if self.left == 0 {
            None
        } else {
            self.left -= 1;
            Some(self.r)
        }
    }

    fn required(&mut self, field: &'static str) -> Result<&mut Reader<'a>, DecodeError> {
        self.next().ok_or(DecodeError::MissingField { field })
    }

    /// The next element unless the array ended or it is nil.
    fn optional(&mut self, field: &'static str) -> Result<Option<&mut Reader<'a>>, DecodeError> {
        match self.next() {
            None => Ok(None),
            Some(r) => {
                if r.try_nil().at(field, "value")? {
                    Ok(None)
                } else {
                    Ok(Some(r))
                }
            }
        }
    }

    fn skip_rest(&mut self) -> Result<(), DecodeError> {
        while let Some(r) = self.next() {
            r.skip().at("event", "msgpack value")?;
        }
        Ok(())
    }
}

fn decode_positional<'a>(
    r: &mut Reader<'a>,
    spares: &mut Spares,
) -> Result<RawEvent<'a>, DecodeError> {
    let len = r.read_array_len().at("event", "array")?;
    let mut p = Positional { r, left: len };
    let tag = p.required("type")?.read_str().at("type", "string")?;
    let event = match tag {
        "BlockStored" => RawEvent::Stored(positional_stored(&mut p, spares)?),
        "BlockRemoved" => {
            let block_hashes = read_hashes(p.required("block_hashes")?, "block_hashes", spares)?;
            let medium = match p.optional("medium")? {
                Some(r) => non_empty(r.read_str().at("medium", "string")?),
                None => None,
            };
            let tail = positional_tail(&mut p, false)?;
            RawEvent::Removed(BlockRemoved {
                block_hashes,
                medium,
                meta: tail.meta,
            })
        }
        "AllBlocksCleared" => {
            let ownership = match p.optional("ownership")? {
                Some(r) => Some(r.read_str().at("ownership", "string")?),
                None => None,
            };
            RawEvent::Cleared(AllBlocksCleared { ownership })
        }
        "Ignored" => RawEvent::Ignored,
        other => return Err(unknown_tag(other)),
    };
    p.skip_rest()?;
    Ok(event)
}

fn positional_stored<'a>(
    p: &mut Positional<'_, 'a>,
    spares: &mut Spares,
) -> Result<BlockStored<'a>, DecodeError> {
    let block_hashes = read_hashes(p.required("block_hashes")?, "block_hashes", spares)?;
    let parent_block_hash = {
        let r = p.required("parent_block_hash")?;
        if r.try_nil().at("parent_block_hash", "hash or nil")? {
            None
        } else {
            Some(read_hash(r, "parent_block_hash")?)
        }
    };
    let (token_ids, is_eagle) = read_token_ids(p.required("token_ids")?, spares)?;
    let block_size = read_uint(p.required("block_size")?, "block_size")?;
    // Legacy lora_id: read and discarded, whatever it is.
    if let Some(r) = p.next() {
        r.skip().at("lora_id", "int or nil")?;
    }
    let medium = match p.optional("medium")? {
        Some(r) => non_empty(r.read_str().at("medium", "string")?),
        None => None,
    };
    let mut lora_name = None;
    let mut cache_salt = None;
    if let Some(r) = p.optional("lora_name")? {
        match r.kind().at("lora_name", "string or map")? {
            Kind::Str => lora_name = non_empty(r.read_str().at("lora_name", "string")?),
            Kind::Map => cache_salt = read_salt_map(r)?,
            _ => {
                return Err(DecodeError::WrongType {
                    field: "lora_name",
                    expected: "string or {\"cache_salt\": string}",
                });
            }
        }
    }
    let extra_keys = match p.optional("extra_keys")? {
        Some(r) => Some(r.take_value().at("extra_keys", "array")?),
        None => None,
    };
    let tail = positional_tail(p, true)?;
    let mut ev = BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        is_eagle,
        block_size,
        medium,
        lora_name,
        cache_salt,
        block_mm_infos: tail.mm_infos,
        meta: tail.meta,
        session_id: None,
    };
    apply_extra_keys(&mut ev, extra_keys)?;
    Ok(ev)
}

/// SGLang's namespace map at position 7: `{"cache_salt": string}`.
fn read_salt_map<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    const FIELD: &str = "cache_salt";
    let pairs = r.read_map_len().at(FIELD, "map")?;
    let mut salt = None;
    let mut seen = false;
    for _ in 0..pairs {
        match read_key(r)? {
            Some("cache_salt") => {
                seen = true;
                salt = if r.try_nil().at(FIELD, "string")? {
                    None
                } else {
                    non_empty(r.read_str().at(FIELD, "string")?)
                };
            }
            _ => r.skip().at(FIELD, "msgpack value")?,
        }
    }
    if seen {
        Ok(salt)
    } else {
        Err(DecodeError::MissingField { field: FIELD })
    }
}

/// What the optional tail after the fixed prefix yields.
#[derive(Default)]
struct Tail<'a> {
    meta: GroupMeta<'a>,
    mm_infos: Option<Vec<Option<BlockMmInfo>>>,
}

/// One inspected tail element, classified by msgpack type.
enum TailItem<'a> {
    Nil,
    Uint(u64),
    Str(&'a str),
    Array(Reader<'a>),
    Other,
}

const TAIL_INSPECTED: usize = 5;

/// The optional tail (§5.2): fixed layout when it fits, else legacy classification by type.
/// Never fails on element types, only on malformed msgpack.
fn positional_tail<'a>(p: &mut Positional<'_, 'a>, with_mm: bool) -> Result<Tail<'a>, DecodeError> {
    let mut items: [Option<TailItem<'a>>; TAIL_INSPECTED] = Default::default();
    let mut count = 0;
    while count < TAIL_INSPECTED {
        let Some(r) = p.next() else { break };
        let item = match r.kind().at("tail", "msgpack value")? {
            Kind::Nil => {
                r.skip().at("tail", "nil")?;
                TailItem::Nil
            }
            Kind::Int => match u64::try_from(r.read_int().at("tail", "int")?) {
                Ok(v) => TailItem::Uint(v),
                Err(_) => TailItem::Other,
            },
            Kind::Str => match r.read_str() {
                Ok(s) => TailItem::Str(s),
                Err(WireError::BadUtf8) => TailItem::Other,
                Err(e) => return Err(DecodeError::wire(e, "tail", "string")),
            },
            Kind::Array => TailItem::Array(r.take_value().at("tail", "array")?),
            _ => {
                r.skip().at("tail", "msgpack value")?;
                TailItem::Other
            }
        };
        items[count] = Some(item);
        count += 1;
    }
    let items = &items[..count];
    let fits = |i: usize, item: &TailItem<'_>| match item {
        TailItem::Nil => true,
        TailItem::Uint(v) => matches!(i, 0 | 2) && u32::try_from(*v).is_ok(),
        TailItem::Str(_) => matches!(i, 1 | 3 | 4),
        TailItem::Array(_) | TailItem::Other => false,
    };
    let fixed = count >= 4
        && items
            .iter()
            .enumerate()
            .all(|(i, it)| it.as_ref().is_some_and(|it| fits(i, it)));
    let mut tail = Tail::default();
    if fixed {
        for (i, item) in items.iter().enumerate() {
            match (i, item) {
                (0, Some(TailItem::Uint(v))) => tail.meta.group_idx = u32::try_from(*v).ok(),
                (1, Some(TailItem::Str(s))) => tail.meta.kind = Some(CacheSpecKind::parse(s)),
                (2, Some(TailItem::Uint(v))) => {
                    tail.meta.sliding_window = u32::try_from(*v).ok();
                }
                (3, Some(TailItem::Str(s))) => tail.meta.locality = Some(Locality::parse(s)),
                (4, Some(TailItem::Str(s))) => tail.meta.ownership = Some(s),
                _ => {}
            }
        }
    } else {
        let mut uints = 0;
        for item in items.iter().flatten() {
            match item {
                TailItem::Uint(v) => {
                    if let Ok(v) = u32::try_from(*v) {
                        match uints {
                            0 => tail.meta.group_idx = Some(v),
                            1 => tail.meta.sliding_window = Some(v),
                            _ => {}
                        }
                        uints += 1;
                    }
                }
                TailItem::Str(s) => tail.meta.kind = Some(CacheSpecKind::parse(s)),
                TailItem::Array(r) if with_mm => {
                    let mut r = *r;
                    if let Ok(infos) = read_mm_infos(&mut r) {
                        tail.mm_infos = Some(infos);
                    }
                }
                _ => {}
            }
        }
    }
    Ok(tail)
}

// ---------------------------------------------------------------------------------------
// Map form
// ---------------------------------------------------------------------------------------

/// The known keys of a map-form event, each as the raw bytes of its value (keys are
/// unordered, and `type` decides how the others are read).
#[derive(Default)]
struct MapFields<'a> {
    tag: Option<Reader<'a>>,
    block_hashes: Option<Reader<'a>>,
    parent_block_hash: Option<Reader<'a>>,
    token_ids: Option<Reader<'a>>,
    block_size: Option<Reader<'a>>,
    medium: Option<Reader<'a>>,
    lora_name: Option<Reader<'a>>,
    cache_salt: Option<Reader<'a>>,
    extra_keys: Option<Reader<'a>>,
    block_mm_infos: Option<Reader<'a>>,
    group_idx: Option<Reader<'a>>,
    kind: Option<Reader<'a>>,
    sliding_window: Option<Reader<'a>>,
    locality: Option<Reader<'a>>,
    ownership: Option<Reader<'a>>,
    session_id: Option<Reader<'a>>,
}

fn decode_map<'a>(r: &mut Reader<'a>, spares: &mut Spares) -> Result<RawEvent<'a>, DecodeError> {
    let pairs = r.read_map_len().at("event", "map")?;
    let mut f = MapFields::default();
    for _ in 0..pairs {
        let slot = match read_key(r)? {
            Some("type") => &mut f.tag,
            Some("block_hashes") => &mut f.block_hashes,
            Some("parent_block_hash") => &mut f.parent_block_hash,
            Some("token_ids") => &mut f.token_ids,
            Some("block_size") => &mut f.block_size,
            Some("medium") => &mut f.medium,
            Some("lora_name") => &mut f.lora_name,
            Some("cache_salt") => &mut f.cache_salt,
            Some("extra_keys") => &mut f.extra_keys,
            Some("block_mm_infos") => &mut f.block_mm_infos,
            Some("group_idx") => &mut f.group_idx,
            Some("kv_cache_spec_kind") => &mut f.kind,
            Some("kv_cache_spec_sliding_window") => &mut f.sliding_window,
            Some("locality") => &mut f.locality,
            Some("ownership") => &mut f.ownership,
            Some("session_id") => &mut f.session_id,
            _ => {
                r.skip().at("event", "msgpack value")?;
                continue;
            }
        };
        *slot = Some(r.take_value().at("event", "msgpack value")?);
    }
    let Some(mut tag) = f.tag else {
        return Err(DecodeError::MissingField { field: "type" });
    };
    match tag.read_str().at("type", "string")? {
        "BlockStored" => map_stored(f, spares).map(RawEvent::Stored),
        "BlockRemoved" => Ok(RawEvent::Removed(BlockRemoved {
            block_hashes: match f.block_hashes {
                Some(mut r) => read_hashes(&mut r, "block_hashes", spares)?,
                None => {
                    return Err(DecodeError::MissingField {
                        field: "block_hashes",
                    });
                }
            },
            medium: opt_str(f.medium, "medium")?.and_then(non_empty),
            meta: map_meta(&f)?,
        })),
        "AllBlocksCleared" => Ok(RawEvent::Cleared(AllBlocksCleared {
            ownership: opt_str(f.ownership, "ownership")?,
        })),
        "Ignored" => Ok(RawEvent::Ignored),
        other => Err(unknown_tag(other)),
    }
}

fn map_stored<'a>(f: MapFields<'a>, spares: &mut Spares) -> Result<BlockStored<'a>, DecodeError> {
    let mut block_hashes = f.block_hashes.ok_or(DecodeError::MissingField {
        field: "block_hashes",
    })?;
    let mut token_ids = f
        .token_ids
        .ok_or(DecodeError::MissingField { field: "token_ids" })?;
    let mut block_size = f.block_size.ok_or(DecodeError::MissingField {
        field: "block_size",
    })?;
    let (tokens, is_eagle) = read_token_ids(&mut token_ids, spares)?;
    let block_mm_infos = match present(f.block_mm_infos, "block_mm_infos")? {
        Some(mut r) => Some(read_mm_infos(&mut r).at("block_mm_infos", "array of mm infos")?),
        None => None,
    };
    let mut ev = BlockStored {
        block_hashes: read_hashes(&mut block_hashes, "block_hashes", spares)?,
        parent_block_hash: match present(f.parent_block_hash, "parent_block_hash")? {
            Some(mut r) => Some(read_hash(&mut r, "parent_block_hash")?),
            None => None,
        },
        token_ids: tokens,
        is_eagle,
        block_size: read_uint(&mut block_size, "block_size")?,
        medium: opt_str(f.medium, "medium")?.and_then(non_empty),
        lora_name: opt_str(f.lora_name, "lora_name")?.and_then(non_empty),
        cache_salt: opt_str(f.cache_salt, "cache_salt")?.and_then(non_empty),
        block_mm_infos,
        meta: map_meta(&f)?,
        session_id: opt_str(f.session_id, "session_id")?,
    };
    apply_extra_keys(&mut ev, present(f.extra_keys, "extra_keys")?)?;
    Ok(ev)
}

fn map_meta<'a>(f: &MapFields<'a>) -> Result<GroupMeta<'a>, DecodeError> {
    Ok(GroupMeta {
        group_idx: opt_u32(f.group_idx, "group_idx")?,
        kind: opt_str(f.kind, "kv_cache_spec_kind")?.map(CacheSpecKind::parse),
        sliding_window: opt_u32(f.sliding_window, "kv_cache_spec_sliding_window")?,
        locality: opt_str(f.locality, "locality")?.map(Locality::parse),
        ownership: opt_str(f.ownership, "ownership")?,
    })
}

/// A map value that is present and not nil.
fn present<'a>(
    r: Option<Reader<'a>>,
    field: &'static str,
) -> Result<Option<Reader<'a>>, DecodeError> {
    match r {
        Some(mut r) => {
            if r.try_nil().at(field, "value")? {
                Ok(None)
            } else {
                Ok(Some(r))
            }
        }
        None => Ok(None),
    }
}

fn opt_str<'a>(r: Option<Reader<'a>>, field: &'static str) -> Result<Option<&'a str>, DecodeError> {
    match present(r, field)? {
        Some(mut r) => r.read_str().map(Some).at(field, "string"),
        None => Ok(None),
    }
}

fn opt_u32(r: Option<Reader<'_>>, field: &'static str) -> Result<Option<u32>, DecodeError> {
    match present(r, field)? {
        Some(mut r) => {
            let v = read_uint(&mut r, field)?;
            u32::try_from(v)
                .map(Some)
                .map_err(|_| DecodeError::OutOfRange { field })
        }
        None => Ok(None),
    }
}

// ---------------------------------------------------------------------------------------
// Shared field decoders
// ---------------------------------------------------------------------------------------

fn non_empty(s: &str) -> Option<&str> {
    if s.is_empty() { None } else { Some(s) }
}

fn read_uint(r: &mut Reader<'_>, field: &'static str) -> Result<u64, DecodeError> {
    let v = r.read_int().at(field, "unsigned int")?;
    u64::try_from(v).map_err(|_| DecodeError::OutOfRange { field })
}

fn read_u32(r: &mut Reader<'_>, field: &'static str) -> Result<u32, DecodeError> {
    r.read_u32()
        .at(field, "u32")?
        .ok_or(DecodeError::OutOfRange { field })
}

/// A block hash: any 64-bit int (negative ones bit-reinterpreted) or raw hash bytes, which
/// map like vLLM's own int conversion (big-endian, low 64 bits).
fn read_hash(r: &mut Reader<'_>, field: &'static str) -> Result<ExternalHash, DecodeError> {
    match r.kind().at(field, "int or bytes")? {
        Kind::Bin => {
            let bytes = r.read_bin().at(field, "bytes")?;
            let low = &bytes[bytes.len().saturating_sub(8)..];
            Ok(ExternalHash(
                low.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)),
            ))
        }
        // Two's complement truncation: -1 → u64::MAX; every msgpack int fits 64 bits.
        _ => Ok(ExternalHash(r.read_int().at(field, "int or bytes")? as u64)),
    }
}

fn read_hashes(
    r: &mut Reader<'_>,
    field: &'static str,
    spares: &mut Spares,
) -> Result<Vec<ExternalHash>, DecodeError> {
    let n = r.read_array_len().at(field, "array")?;
    let mut out = spares.hashes();
    out.reserve(n);
    for _ in 0..n {
        out.push(read_hash(r, field)?);
    }
    Ok(out)
}

/// Flat `u32` tokens, or Eagle `[u32, u32]` pairs flattened to `n + 1` tokens (§5.1).
fn read_token_ids(
    r: &mut Reader<'_>,
    spares: &mut Spares,
) -> Result<(Vec<u32>, bool), DecodeError> {
    const FIELD: &str = "token_ids";
    let n = r.read_array_len().at(FIELD, "array")?;
    if n == 0 {
        return Ok((Vec::new(), false));
    }
    let pairs = r.kind().at(FIELD, "array")? == Kind::Array;
    let mut out = spares.ids();
    out.reserve(n + usize::from(pairs));
    if pairs {
        let mut last = 0;
        for _ in 0..n {
            if r.read_array_len().at(FIELD, "[u32, u32] pair")? != 2 {
                return Err(DecodeError::WrongType {
                    field: FIELD,
                    expected: "[u32, u32] pair",
                });
            }
            out.push(read_u32(r, FIELD)?);
            last = read_u32(r, FIELD)?;
        }
        out.push(last);
    } else if !r.read_u32_seq(n, &mut out).at(FIELD, "u32")? {
        return Err(DecodeError::OutOfRange { field: FIELD });
    }
    Ok((out, pairs))
}

/// `block_mm_infos`: per block nil or `{"mm_objects": [{"mm_hash": u64, "offsets": [[s, e], …]}]}`.
fn read_mm_infos(r: &mut Reader<'_>) -> Result<Vec<Option<BlockMmInfo>>, WireError> {
    let n = r.read_array_len()?;
    let mut out = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        if r.try_nil()? {
            out.push(None);
            continue;
        }
        let mut info = BlockMmInfo::default();
        for _ in 0..r.read_map_len()? {
            if r.kind()? == Kind::Str && r.read_str()? == "mm_objects" {
                if r.try_nil()? {
                    continue;
                }
                for _ in 0..r.read_array_len()? {
                    info.mm_objects.push(read_mm_object(r)?);
                }
            } else {
                r.skip()?;
            }
        }
        out.push(Some(info));
    }
    Ok(out)
}

fn read_mm_object(r: &mut Reader<'_>) -> Result<MmObject, WireError> {
    let mut mm_hash = None;
    let mut offsets = Vec::new();
    for _ in 0..r.read_map_len()? {
        let key = if r.kind()? == Kind::Str {
            r.read_str()?
        } else {
            r.skip()?;
            ""
        };
        match key {
            "mm_hash" => mm_hash = Some(r.read_int()? as u64),
            "offsets" if !r.try_nil()? => {
                for _ in 0..r.read_array_len()? {
                    if r.read_array_len()? != 2 {
                        return Err(WireError::WrongType);
                    }
                    let start = u64::try_from(r.read_int()?).map_err(|_| WireError::WrongType)?;
                    let end = u64::try_from(r.read_int()?).map_err(|_| WireError::WrongType)?;
                    offsets.push([start, end]);
                }
            }
            "offsets" => {}
            _ => r.skip()?,
        }
    }
    Ok(MmObject {
        mm_hash: mm_hash.ok_or(WireError::WrongType)?,
        offsets,
    })
}

/// Derives the salt and multimodal infos from vLLM `extra_keys` (§5.6), only for what the
/// event does not carry explicitly. Validates the shape either way.
fn apply_extra_keys<'a>(
    ev: &mut BlockStored<'a>,
    extra_keys: Option<Reader<'a>>,
) -> Result<(), DecodeError> {
    const FIELD: &str = "extra_keys";
    let Some(mut r) = extra_keys else {
        return Ok(());
    };
    if r.try_nil().at(FIELD, "array")? {
        return Ok(());
    }
    let want_salt = ev.cache_salt.is_none();
    let want_mm = ev.block_mm_infos.is_none();
    let n = r.read_array_len().at(FIELD, "array")?;
    let mut mm: Vec<Option<BlockMmInfo>> = Vec::new();
    let mut any_mm = false;
    let mut salt = None;
    for block in 0..n {
        if r.try_nil().at(FIELD, "array or nil")? {
            if want_mm {
                mm.push(None);
            }
            continue;
        }
        let items = r.read_array_len().at(FIELD, "array or nil")?;
        let mut lora_skip_pending = ev.lora_name.is_some();
        let mut info = BlockMmInfo::default();
        for _ in 0..items {
            match r.kind().at(FIELD, "key item")? {
                Kind::Str => {
                    let s = r.read_str().at(FIELD, "string")?;
                    if want_salt && block == 0 && salt.is_none() {
                        if lora_skip_pending && Some(s) == ev.lora_name {
                            lora_skip_pending = false;
                        } else if let Some(rest) = s.strip_prefix(SALT_PREFIX)
                            && !rest.is_empty()
                        {
                            salt = Some(rest);
                        }
                    }
                    if want_mm && let Some(h) = routing_mm_hash(s) {
                        info.mm_objects.push(MmObject {
                            mm_hash: h,
                            offsets: Vec::new(),
                        });
                    }
                }
                Kind::Array => {
                    // `[string, start_offset]` (vLLM ≥ 0.19); other arrays carry nothing we use.
                    let mut item = r.take_value().at(FIELD, "key item")?;
                    if item.read_array_len() == Ok(2)
                        && let Ok(s) = item.read_str()
                        && want_mm
                        && let Some(h) = routing_mm_hash(s)
                    {
                        info.mm_objects.push(MmObject {
                            mm_hash: h,
                            offsets: Vec::new(),
                        });
                    }
                }
                _ => r.skip().at(FIELD, "key item")?,
            }
        }
        if want_mm {
            if info.mm_objects.is_empty() {
                mm.push(None);
            } else {
                any_mm = true;
                mm.push(Some(info));
            }
        }
    }
    if want_salt {
        ev.cache_salt = salt;
    }
    if want_mm && any_mm {
        ev.block_mm_infos = Some(mm);
    }
    Ok(())
}

/// The frontend's routing-hash marker: 16 hex digits then 48 `'0'` (§5.6).
fn routing_mm_hash(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 64
        || !b[..16].iter().all(u8::is_ascii_hexdigit)
        || !b[16..].iter().all(|&c| c == b'0')
    {
        return None;
    }
    u64::from_str_radix(s.get(..16)?, 16).ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rmpv::Value;

    use super::*;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn ints(xs: &[u64]) -> Value {
        Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
    }

    fn batch(events: Vec<Value>) -> Vec<u8> {
        enc(&Value::Array(vec![
            Value::F64(1.0),
            Value::Array(events),
            Value::Nil,
        ]))
    }

    fn stored(ev: Value) -> BlockStored<'static> {
        let bytes = Box::leak(batch(vec![ev]).into_boxed_slice());
        let b = decode_batch(bytes).expect("decodes");
        match b.events.into_iter().next() {
            Some(RawEvent::Stored(s)) => s,
            other => panic!("not a store: {other:?}"),
        }
    }

    /// kv-events §4: the batch is an array; a map (even one with the array's three members
    /// under names) is rejected as a batch of the wrong shape.
    #[test]
    fn map_batch_form_is_rejected() {
        let v = Value::Map(vec![
            (s("ts"), Value::F64(2.0)),
            (
                s("events"),
                Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
            ),
            (s("data_parallel_rank"), Value::from(-1)),
        ]);
        let err = decode_batch(&enc(&v)).expect_err("a map batch is not the contract's");
        assert_eq!(
            err,
            DecodeError::WrongType {
                field: "batch",
                expected: "array",
            }
        );
        assert_eq!(
            crate::DropReason::from(&err),
            crate::DropReason::BadBatchShape
        );
        // An empty map too.
        assert!(decode_batch(&[0x80]).is_err());
    }

    #[test]
    fn dp_rank_outside_i32_is_an_error() {
        let v = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![]),
            Value::from(1u64 << 40),
        ]);
        assert_eq!(
            decode_batch(&enc(&v)),
            Err(DecodeError::OutOfRange {
                field: "data_parallel_rank"
            })
        );
    }

    #[test]
    fn byte_hashes_use_the_low_64_bits_big_endian() {
        let mut raw = vec![0xAAu8; 24];
        raw.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let ev = stored(Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![Value::Binary(raw), Value::Binary(vec![1, 2])]),
            ),
            (s("parent_block_hash"), Value::Binary(vec![0xff; 8])),
            (s("token_ids"), ints(&[1, 2, 3, 4])),
            (s("block_size"), Value::from(4)),
            (s("some_future_key"), Value::Map(vec![(s("x"), Value::Nil)])),
        ]));
        assert_eq!(
            ev.block_hashes,
            vec![ExternalHash(0x0102_0304_0506_0708), ExternalHash(0x0102)]
        );
        assert_eq!(ev.parent_block_hash, Some(ExternalHash(u64::MAX)));
    }

    #[test]
    fn wrong_type_in_present_map_key_fails_the_batch() {
        let ev = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), ints(&[1])),
            (s("token_ids"), ints(&[1, 2, 3, 4])),
            (s("block_size"), Value::from(4)),
            (s("medium"), Value::from(3)),
        ]);
        assert!(matches!(
            decode_batch(&batch(vec![ev])),
            Err(DecodeError::WrongType {
                field: "medium",
                ..
            })
        ));
        let missing = Value::Map(vec![(s("block_hashes"), ints(&[1]))]);
        assert_eq!(
            decode_batch(&batch(vec![missing])),
            Err(DecodeError::MissingField { field: "type" })
        );
    }

    #[test]
    fn salt_map_shapes() {
        let base = |slot: Value| {
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1, 2, 3, 4]),
                Value::from(4),
                Value::Nil,
                s("GPU"),
                slot,
            ])
        };
        let ok = stored(base(Value::Map(vec![(s("cache_salt"), s("t"))])));
        assert_eq!(ok.cache_salt, Some("t"));
        let lora = stored(base(s("adapter")));
        assert_eq!(lora.lora_name, Some("adapter"));
        assert_eq!(lora.cache_salt, None);
        for bad in [
            Value::Map(vec![]),
            Value::Map(vec![(s("cache_salt"), Value::from(123))]),
            Value::from(5),
        ] {
            assert!(
                decode_batch(&batch(vec![base(bad.clone())])).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn legacy_tail_classifies_by_type() {
        // Old vLLM: extra_keys then [group_idx, kind] only (2-element tail).
        let ev = stored(Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            ints(&[1, 2, 3, 4]),
            Value::from(4),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::from(2),
            s("mamba"),
        ]));
        assert_eq!(ev.meta.group_idx, Some(2));
        assert_eq!(ev.meta.kind, Some(CacheSpecKind::Mamba));
        assert_eq!(ev.meta.locality, None);
        // Fixed layout with ownership, plus surplus elements skipped.
        let ev = stored(Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            ints(&[1, 2, 3, 4]),
            Value::from(4),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::from(0),
            s("full_attention"),
            Value::Nil,
            s("LOCAL"),
            s("kvcr"),
            Value::Map(vec![]),
            Value::from(9),
        ]));
        assert_eq!(ev.meta.ownership, Some("kvcr"));
        assert_eq!(ev.meta.locality, Some(Locality::Local));
        // A multimodal-info array in a legacy tail.
        let mm = Value::Array(vec![
            Value::Nil,
            Value::Map(vec![(
                s("mm_objects"),
                Value::Array(vec![Value::Map(vec![
                    (s("mm_hash"), Value::from(77)),
                    (s("offsets"), Value::Array(vec![ints(&[0, 2])])),
                ])]),
            )]),
        ]);
        let ev = stored(Value::Array(vec![
            s("BlockStored"),
            ints(&[1, 2]),
            Value::Nil,
            ints(&[1, 2, 3, 4, 5, 6, 7, 8]),
            Value::from(4),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            mm,
        ]));
        let infos = ev.block_mm_infos.expect("mm infos");
        assert_eq!(infos.len(), 2);
        assert_eq!(infos[1].as_ref().unwrap().mm_objects[0].mm_hash, 77);
        assert_eq!(
            infos[1].as_ref().unwrap().mm_objects[0].offsets,
            vec![[0, 2]]
        );
    }

    #[test]
    fn extra_keys_yield_salt_and_routing_mm_hashes() {
        let marker = format!("{:016x}{}", 0xabcdu64, "0".repeat(48));
        // A native 64-hex digest with a non-zero tail is deliberately not a marker.
        let digest = "f".repeat(64);
        let ev = stored(Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), ints(&[1, 2])),
            (s("token_ids"), ints(&[1, 2, 3, 4, 5, 6, 7, 8])),
            (s("block_size"), Value::from(4)),
            (s("lora_name"), s("dynamo-cache-salt:lora")),
            (
                s("extra_keys"),
                Value::Array(vec![
                    Value::Array(vec![
                        s("dynamo-cache-salt:lora"),
                        s("untagged"),
                        s("dynamo-cache-salt:"),
                        s("dynamo-cache-salt:tenant"),
                    ]),
                    Value::Array(vec![
                        Value::Array(vec![s(&marker), Value::from(3)]),
                        s(&digest),
                        Value::Boolean(true),
                        Value::F64(0.5),
                    ]),
                ]),
            ),
        ]));
        assert_eq!(ev.cache_salt, Some("tenant"));
        let infos = ev.block_mm_infos.expect("mm");
        assert_eq!(infos[0], None);
        assert_eq!(infos[1].as_ref().unwrap().mm_objects.len(), 1);
        assert_eq!(infos[1].as_ref().unwrap().mm_objects[0].mm_hash, 0xabcd);
    }

    #[test]
    fn eagle_pairs_and_bad_tokens() {
        let pairs = Value::Array(vec![ints(&[1, 2]), ints(&[2, 3])]);
        let ev = stored(Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            pairs,
            Value::from(2),
        ]));
        assert!(ev.is_eagle);
        assert_eq!(ev.token_ids, vec![1, 2, 3]);
        let too_big = Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            ints(&[1 << 33]),
            Value::from(2),
        ]);
        assert_eq!(
            decode_batch(&batch(vec![too_big])),
            Err(DecodeError::OutOfRange { field: "token_ids" })
        );
        let short = Value::Array(vec![s("BlockStored"), ints(&[1]), Value::Nil, ints(&[1])]);
        assert_eq!(
            decode_batch(&batch(vec![short])),
            Err(DecodeError::MissingField {
                field: "block_size"
            })
        );
    }

    #[test]
    fn live_framing_errors() {
        assert_eq!(
            parse_live_frames(&[b"", b"12345678"]),
            Err(FrameError::WrongFrameCount { count: 2 })
        );
        assert_eq!(
            parse_live_frames(&[b"", b"1234", b""]),
            Err(FrameError::BadSeqLength { len: 4 })
        );
    }

    #[test]
    fn hostile_payloads_are_rejected() {
        // events = array32 claiming 2^32-1 elements.
        let mut p = vec![0x93, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            decode_batch(&p),
            Err(DecodeError::Malformed { .. })
        ));
        // Deeply nested unknown map value inside an event.
        p = vec![0x93, 0x01, 0x91, 0x82, 0xa4];
        p.extend_from_slice(b"type");
        p.push(0xa7);
        p.extend_from_slice(b"Ignored");
        p.push(0xa1);
        p.push(b'x');
        p.extend(std::iter::repeat_n(0x91, 100_000));
        p.push(0xc0);
        p.push(0xc0);
        let b = decode_batch(&p).expect("deep nesting in an ignored key is fine");
        assert_eq!(b.events, vec![RawEvent::Ignored]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_batch(&bytes);
        }

        /// Mutations of a valid batch reach deeper decoder paths than random bytes.
        #[test]
        fn mutated_valid_batches_never_panic(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
            cut in any::<usize>(),
        ) {
            let mut p = valid_sample();
            for (at, b) in flips {
                let i = at % p.len();
                p[i] = b;
            }
            p.truncate(cut % (p.len() + 1));
            let _ = decode_batch(&p);
            // The normalizer must survive whatever decodes.
            let mut n = crate::Normalizer::new(kv_types::WorkerKey::new(1, 0), 4);
            let mut ops = Vec::new();
            let _ = n.process_payload(&p, 0, &mut ops, |_| {});
        }
    }

    fn valid_sample() -> Vec<u8> {
        batch(vec![
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1, 2]),
                Value::from(-3),
                ints(&[1, 2, 3, 4, 5, 6, 7, 8]),
                Value::from(4),
                Value::Nil,
                s("GPU"),
                Value::Map(vec![(s("cache_salt"), s("t"))]),
                Value::Array(vec![
                    Value::Array(vec![s("dynamo-cache-salt:x")]),
                    Value::Nil,
                ]),
                Value::from(0),
                s("full_attention"),
                Value::Nil,
                s("LOCAL"),
            ]),
            Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), ints(&[1])),
                (s("medium"), s("CPU")),
            ]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ])
    }
}
